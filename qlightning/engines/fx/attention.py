"""``nn.MultiheadAttention`` as four ``nn.Linear`` projections around a float attention core, for FX.

torch.ao FX keeps ``nn.MultiheadAttention`` a leaf: its projections stay float, and its custom-module
flow (``torch.ao.nn.quantizable.MultiheadAttention``) quantizes the module's inputs only (``fx/convert.py``,
``_is_custom_module_mha``: "Additional handling is yet to be implemented for the outputs", torch 2.13-2.14.1);
the quantizable class's own forward does not trace (asserts on shapes). :class:`ProjectedMultiheadAttention`
splits the module as that class does (``linear_Q``/``linear_K``/``linear_V``/``out_proj``, each with its own
qparams) but keeps the attention itself in :class:`AttentionCore`, a leaf the engine never traces: the
projections are ordinary Linears that FX quantizes like any other, and the core reads ``self.training`` at
run time (attention dropout) and may branch on masks and shapes.
"""

from __future__ import annotations

import math
from typing import Collection, Optional

import torch
import torch.nn.functional as F
from torch import nn


class AttentionCore(nn.Module):
    """The part of ``nn.MultiheadAttention`` between its in- and out-projections: heads, masks, softmax,
    attention dropout. It computes what ``F.multi_head_attention_forward`` computes after its in-projection
    (the same ``scaled_dot_product_attention`` call without weights; ``bmm`` / softmax with them).

    Args:
        num_heads: the heads the embedding is split into.
        dropout: dropout on the attention weights, in training only.
        batch_first: the inputs are ``(batch, seq, feature)`` rather than ``(seq, batch, feature)``.
    """

    def __init__(self, num_heads: int, dropout: float = 0.0, batch_first: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attend with the projected queries over the projected keys and values.

        Args:
            q: the projected query, laid out as the module's inputs (batch first or not; or one sequence).
            k: the projected key.
            v: the projected value.
            key_padding_mask: source positions not attended, per batch row (bool: True is masked; float: added).
            need_weights: also return the attention weights (computed with ``matmul`` / softmax, not ``scaled_dot_product_attention``).
            attn_mask: a mask of target x source, or per batch row and head (bool or additive float).
            average_attn_weights: return the weights averaged over the heads.
            is_causal: the hint of ``nn.MultiheadAttention`` (``attn_mask`` must then be the causal mask).

        Returns:
            The attention output in the query's layout, and the weights or ``None``.
        """
        batched = q.dim() == 3
        if not batched:  # one sequence: (seq, feature)
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        batch, target, embed = q.shape
        source = k.shape[1]
        heads, head_dim = self.num_heads, embed // self.num_heads
        q = q.reshape(batch, target, heads, head_dim).transpose(1, 2)
        k = k.reshape(batch, source, heads, head_dim).transpose(1, 2)
        v = v.reshape(batch, source, heads, head_dim).transpose(1, 2)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention).")
        key_padding_mask = _additive(key_padding_mask, q.dtype)
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # as torch: the hint alone goes to scaled_dot_product_attention
        else:
            attn_mask = _additive(attn_mask, q.dtype)
            if attn_mask is not None:
                attn_mask = attn_mask.view(batch, heads, target, source) if attn_mask.dim() == 3 and attn_mask.size(0) > 1 \
                    else attn_mask.reshape(1, 1, target, source)
            if key_padding_mask is not None:
                is_causal = False
                padding = key_padding_mask.view(batch, 1, 1, source)
                attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = F.softmax(scores, dim=-1)
            if dropout > 0.0:
                weights = F.dropout(weights, p=dropout)
            out = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout, is_causal)
            weights = None
        out = out.transpose(1, 2).reshape(batch, target, embed)
        if not batched:
            return out.squeeze(0), (weights.squeeze(0) if weights is not None else None)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def extra_repr(self) -> str:
        """The heads, dropout and layout, in the module's repr."""
        return f"num_heads={self.num_heads}, dropout={self.dropout}, batch_first={self.batch_first}"


def _additive(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A boolean mask (True: not attended) as the additive float mask torch turns it into."""
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


class ProjectedMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its projections as four ``nn.Linear`` (``linear_Q``, ``linear_K``,
    ``linear_V``, ``out_proj``, named as ``torch.ao.nn.quantizable.MultiheadAttention`` names them) and the
    attention in an :class:`AttentionCore`. Same call, same outputs (float rounding aside).

    Args:
        embed_dim: the model width (the query's features).
        num_heads: the heads.
        dropout: attention-weight dropout in training.
        bias: whether the projections have biases.
        kdim: the key's features (default ``embed_dim``).
        vdim: the value's features (default ``embed_dim``).
        batch_first: ``(batch, seq, feature)`` inputs.

    Example::

        attention = ProjectedMultiheadAttention.from_float(nn.MultiheadAttention(64, 4, batch_first=True))
        out, _ = attention(x, x, x, need_weights=False)
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 kdim: Optional[int] = None, vdim: Optional[int] = None, batch_first: bool = False) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.batch_first = batch_first
        self.linear_Q = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.linear_K = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.linear_V = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.attention = AttentionCore(num_heads, dropout, batch_first)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    @staticmethod
    def splits(module: nn.Module) -> Optional[str]:
        """Why ``module`` cannot be split, or ``None`` when it can.

        Args:
            module: an ``nn.MultiheadAttention``.
        """
        if module.bias_k is not None or module.add_zero_attn:
            return "add_bias_kv / add_zero_attn extend the keys inside the attention"
        return None

    @classmethod
    def from_float(cls, module: nn.MultiheadAttention) -> "ProjectedMultiheadAttention":
        """The split of ``module``, holding copies of its weights (on its device and dtype).

        Args:
            module: an ``nn.MultiheadAttention`` that :meth:`splits`.
        """
        reason = cls.splits(module)
        if reason is not None:
            raise ValueError(f"nn.MultiheadAttention cannot be split into projections: {reason}")
        has_bias = module.in_proj_bias is not None
        new = cls(module.embed_dim, module.num_heads, module.dropout, has_bias, module.kdim, module.vdim,
                  module.batch_first).to(device=module.out_proj.weight.device, dtype=module.out_proj.weight.dtype)
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.detach().chunk(3)
        else:
            weights = (module.q_proj_weight.detach(), module.k_proj_weight.detach(), module.v_proj_weight.detach())
        biases = module.in_proj_bias.detach().chunk(3) if has_bias else (None,) * 3
        with torch.no_grad():
            for linear, weight, bias in zip((new.linear_Q, new.linear_K, new.linear_V), weights, biases):
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            new.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                new.out_proj.bias.copy_(module.out_proj.bias)
        new.train(module.training)
        return new

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """As ``nn.MultiheadAttention.forward``.

        Args:
            query: the queries.
            key: the keys.
            value: the values.
            key_padding_mask: source positions not attended, per batch row.
            need_weights: also return the attention weights.
            attn_mask: a mask of target x source, or per batch row and head.
            average_attn_weights: return the weights averaged over the heads.
            is_causal: the causal hint (``attn_mask`` must be the causal mask).
        """
        # a Linear acts on the last dim, whatever the layout: only the core needs to know it
        attended = self.attention(self.linear_Q(query), self.linear_K(key), self.linear_V(value), key_padding_mask,
                                  need_weights, attn_mask, average_attn_weights, is_causal)
        return self.out_proj(attended[0]), attended[1]


def split_multihead_attention(module: nn.Module, configured: Collection[str] = ()) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace each ``nn.MultiheadAttention`` under ``module`` that :meth:`ProjectedMultiheadAttention.splits`
    by its split, in place.

    Args:
        module: the model (``module`` itself is never replaced).
        configured: names of modules the user's config treats as wholes (non-traceable, standalone, or
            ``"*"`` for every ``nn.MultiheadAttention``, when its class has an entry of its own): these and
            the modules under them are kept.

    Returns:
        ``{name: (original, split)}`` of the replaced submodules (:func:`unsplit` puts them back).
    """
    replaced = {}
    for name, child in list(module.named_modules()):
        kept = "*" in configured or any(name == c or name.startswith(c + ".") for c in configured)
        if name and type(child) is nn.MultiheadAttention and not kept and ProjectedMultiheadAttention.splits(child) is None:
            split = ProjectedMultiheadAttention.from_float(child)
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, split)
            replaced[name] = (child, split)
    return replaced


def unsplit(module: nn.Module, replaced: dict[str, tuple[nn.Module, nn.Module]]) -> None:
    """Put back the modules :func:`split_multihead_attention` replaced.

    Args:
        module: the model it was given.
        replaced: what it returned.
    """
    for name, (original, _) in replaced.items():
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, original)
