"""One zoo case: a torchvision / timm model (weights=None) on digits upsampled to 32x32x3, a short
QAT fit through ``Trainer.fit`` with the callback, convert, int8 forward, fidelity int8 vs fake-quant
(``fidelity_results``) and float / int8 latency at batch 1 and 32.

Used by ``tests/zoo/test_zoo.py`` and by ``python -m tests.zoo.table`` (the README's zoo table).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TARGET_SQNR_DB = 25.0
TARGET_TOP1 = 0.99
# The fake-quant model must have learned something before int8 vs fake-quant means anything: a model at
# chance returns (nearly) the same logits for every input, and two constant outputs agree at any precision
# (stop 21's short fits: 12 steps left every model but convnext at 6-18 %, and "200 dB" compared constants).
MIN_LEARNED_ACCURACY = 0.25
# BatchNorm momentum of the zoo's from-scratch fits: at torch's 0.1 (0.01 in mobilenet_v3 / efficientnet)
# the running statistics trail weights that move fast from random init, so eval mode stayed at chance
# (efficientnet_b0 after 48 steps: 12 % eval vs 57 % with batch statistics); at 0.5 they follow
# (efficientnet_b0 57 %, mobilenet_v2 86 %).
BN_MOMENTUM = 0.5
ENGINES = ("fx", "pt2e")


def have(*packages: str) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in packages)


# ----------------------------------------------------------------------------------------- models


def _arch(name: str) -> Callable[[], nn.Module]:
    """The architecture as the family recipes build it (``qlightning.examples.vision.ARCHITECTURES``), 10 classes, 32x32."""
    def build() -> nn.Module:
        from qlightning.examples.vision import ARCHITECTURES

        return ARCHITECTURES[name].build(10, 32)

    return build


def _timm_resnet10t() -> nn.Module:  # not a recipe architecture: timm's zero-init last BatchNorms (zero_init_last)
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=10)


class DecoderClassifier(nn.Module):
    """A decoder-only transformer built from a ``transformers`` config (Llama: RMSNorm, rotary positions, SiLU-gated
    MLP, causal attention; random weights) reading a digit's 64 pixels as tokens, classified from the last one."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        config = LlamaConfig(vocab_size=TOKEN_LEVELS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
        self.decoder = LlamaModel(config)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(input_ids=tokens, use_cache=False).last_hidden_state[:, -1])


class EncoderClassifier(nn.Module):
    """A BERT-style encoder as all-MiniLM-L6-v2 is built (``transformers.BertModel``: post-LayerNorm blocks, GELU,
    eps 1e-12; MiniLM's 6 layers of width 384 reduced to 2 of width 64 to fit the zoo's time; random weights) reading
    a digit's 64 pixels as tokens, classified from the mean of its token states (sentence-transformers' pooling)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=TOKEN_LEVELS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=64, hidden_act="gelu", layer_norm_eps=1e-12,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=tokens).last_hidden_state.mean(dim=1))


@dataclass(frozen=True)
class ZooModel:
    name: str
    package: str  # torchvision | timm
    build: Callable[[], nn.Module]
    options: dict = field(default_factory=dict)  # extra callback arguments the model needs (documented)
    steps: int = 48  # enough for the float model to learn digits well above chance (batch 32)
    lr: float = 3e-3
    inputs: str = "images"  # images: (N, 3, 32, 32) floats; tokens: (N, 64) pixel intensities 0..16 as token ids


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("resnet18", "torchvision", _arch("resnet18")),
        ZooModel("resnet50", "torchvision", _arch("resnet50")),
        ZooModel("mobilenet_v2", "torchvision", _arch("mobilenet_v2")),
        ZooModel("mobilenet_v3_small", "torchvision", _arch("mobilenet_v3_small")),
        ZooModel("shufflenet_v2_x0_5", "torchvision", _arch("shufflenet_v2_x0_5")),
        ZooModel("efficientnet_b0", "torchvision", _arch("efficientnet_b0")),
        ZooModel("regnet_x_400mf", "torchvision", _arch("regnet_x_400mf")),
        # the ViTs learn slower from scratch: float 80 % after 192 steps at lr 1e-3 (vit_small_tv), 39 % after 96
        ZooModel("vit_small_tv", "torchvision", _arch("vit_small_tv"), steps=192, lr=1e-3),
        ZooModel("timm_vit_tiny", "timm", _arch("timm_vit_tiny"), steps=144, lr=1e-3),
        ZooModel("timm_convnext_atto", "timm", _arch("timm_convnext_atto")),
        ZooModel("timm_resnet10t", "timm", _timm_resnet10t),
        ZooModel("hf_llama_decoder", "transformers", DecoderClassifier, steps=192, lr=1e-3, inputs="tokens"),
        ZooModel("hf_minilm_encoder", "transformers", EncoderClassifier, steps=192, lr=1e-3, inputs="tokens"),
    )
}


# What the product must say about a model x engine that does not meet the targets: the status of the
# case, regexes its refusal or warnings must match (module / op and the config that routes around it),
# a note for the README table; "xfail": a precise reason naming the upstream issue.
_GATE_NAMES_THE_ROUTE = [
    r"int8 model departs from the fake-quant model",  # the fit-end fidelity gate (on_breach=warn here)
    r"(first departing layer|worst layers): \S+",  # the layer (worst ones when only the agreement breaches)
    r"the fake-quant model against itself on inputs perturbed by 1e-05",  # the reference's own noise floor
    # the config around the layer, or (when input noise flips as many predictions) that they are near-ties
    r"(qconfig_mapping \{'module_name': \[\{'name': '[^']+', 'qconfig': None\}\]\}|sit on near-ties of the fake-quant model)",
]
KNOWN: dict[tuple[str, str], dict[str, Any]] = {
    # FX rows at the edge of the agreement target: int8 vs fake-quant 33-38 dB can flip one or two of 128 near-tied
    # predictions of a model at 60-75 % accuracy, which ones depending on the thread count (stop 22, 2 threads:
    # regnet 0.984; 1 thread: 1.000); the gate warns and names a layer when it does. Every layer computes as trained
    # (the pools and dropouts since requantize_as_trained); what is left is one-LSB differences of int32 against float
    # accumulation in the convolutions, compounding through depth (a helper's per-layer diagnosis, stop 23)
    **{(name, "fx"): {
        "status": "below target",
        "says": _GATE_NAMES_THE_ROUTE,
        "note": "at the edge of the 99 % agreement target: int8 vs fake-quant 33-38 dB under FX can flip 1-2 of 128 "
                "near-tied predictions (thread-count dependent); every layer computes as trained, what remains is "
                "1-LSB int32 vs float accumulation differences compounding through depth",
    } for name in ("mobilenet_v2", "regnet_x_400mf")},
    # the same edge under PT2E: SQNR rose 45.1 -> 48.6 dB when the head's pool got its own observer (stop 34), and 2 of
    # 128 near-tied predictions of a model at 83 % flipped; the gate warns and names the first departing layer
    ("resnet50", "pt2e"): {
        "status": "below target",
        "says": _GATE_NAMES_THE_ROUTE,
        "note": "at the edge of the 99 % agreement target: int8 vs fake-quant 45-49 dB under PT2E can flip 1-2 of 128 "
                "near-tied predictions (stop 33: 45.1 dB, 1.000; stop 34, the pools on their own grid: 48.6 dB, 0.984). "
                "The fake-quant model against itself with its inputs perturbed by 1e-5 (relative) reads 45.8 dB, 0.984: "
                "the same flips, so the gate says they are near-ties rather than naming a layer. Stop 40, seeds 1-4 of "
                "the same fit: 43-48 dB, 1.000 each",
    },
    # PT2E meets the targets on the AVX2 and Xeon CPUs (25-45 dB, 1.000); on an AMD EPYC with AVX-512 (stop 52) the
    # float kernels train another model (54 % accurate) and 2 of its 128 near-tied predictions flip at 44.6 dB
    ("efficientnet_b0", "pt2e"): {
        "status": "below target",
        "says": _GATE_NAMES_THE_ROUTE,
        "note": "at the edge of the 99 % agreement target on some CPUs: on an AMD EPYC with AVX-512 (stop 52) int8 vs "
                "fake-quant 44.6 dB, 2 of 128 predictions of a model at 54 % flip, where the fake-quant model against "
                "itself with its inputs perturbed by 1e-5 (relative) reads 23.7 dB, 0.961; on AVX2 and Xeon CPUs it "
                "meets the targets. KNOWN accepts either outcome",
    },
    ("efficientnet_b0", "fx"): {
        "status": "below target",
        "says": _GATE_NAMES_THE_ROUTE,
        "note": "int8 vs fake-quant 31-32 dB, 4-5 of 128 predictions of a model at 44-49 % flip (stop 33: 31.6 dB / "
                "0.961 with the SE means on their input's grid). The SE blocks' means observe their own grid "
                "(pool_observers) and compute as trained, as does the dropout (requantize_as_trained); what remains "
                "is 1-LSB int32 vs float accumulation differences compounding through 16 MBConv blocks (worst at "
                "features.6-7's depthwise convs). On a Xeon with VNNI inductor computes the same integers (31.4 dB) and "
                "lowering=auto ships it; on an AVX2 EPYC (stop 46) inductor read 29.7 dB against the FX module's 35.2 "
                "and auto kept the FX module (3.0x float at batch 32); since stop 47 (float ops read float values under "
                "inductor on AVX2) it reads 35.7 dB and auto ships it (3.55x). Stop 39: each int8 conv, fed the int8 model's own input, gives the fake-quant conv's codes "
                "in all but 27 of 9.4 million outputs (float32 accumulation), and depth grows those flips to 31.5 dB; "
                "the fake-quant model against itself with its inputs perturbed by 1e-5 (relative) reads 33.6 dB, "
                "0.977, and 31 of its 128 rows have exactly tied (quantized) top-2 logits. Stop 40, seeds 0-4 (2-4 "
                "trained on 1 thread): 19.8-32.6 dB, 0.969-0.984 (its fake-quant model under that noise: 25-34 dB, "
                "0.938-0.984; seed 3 on 2 threads: 30.5 dB, 0.984); longer fits (96, 144 steps) 0.969-1.000",
    },
    ("timm_vit_tiny", "fx"): {
        "status": "below target",
        "says": _GATE_NAMES_THE_ROUTE,
        "note": "int8 vs fake-quant 44 dB (stop 23: 25 dB, fixed at the class token's cat), 2 of 128 near-tied predictions "
                "of a model at 50 % flip; every int8 op is within one LSB of its float emulation on the same input "
                "(fewer than 20 in a million elements differ), and through 4 blocks of LayerNorm and attention those "
                "flips spread (72 dB after the patch conv, 35 dB at the last MLP)",
    },
}


# Rows that need config: prepare with modules=["net"] refuses, and the refusal must name the route (``refusal_says``);
# ``run_case`` then fits again with the modules list the refusal writes (route 1.a), which must meet the targets, int8
# against fake-quant measured on the whole model.
_HF_FX_NOTE = ("transformers 5's {cls}.forward takes **kwargs behind a decorator, where torch.fx stops: prepare with "
               "`modules=['net']` refuses, naming where FX stops and the modules list of the parts that trace (route "
               "1.a); fitted with that list as the refusal writes it, those modules train and run int8 and {rest} stay "
               "float (SQNR and agreement: the whole model's output, int8 vs fake-quant){extra}; PT2E exports the whole "
               "model")
ROUTES: dict[tuple[str, str], dict[str, Any]] = {
    ("hf_llama_decoder", "fx"): {
        "refusal_says": [r"FX stops in net\.decoder \(LlamaModel\): \*args/\*\*kwargs forward",
                         r"\(route 1\.a\): modules=\[.*'net\.decoder\.layers\.\*\.mlp'"],
        "note": _HF_FX_NOTE.format(cls="LlamaModel", rest="attention's matmuls and softmax, the rotary embedding and "
                                   "the RMSNorms", extra=""),
    },
    ("hf_minilm_encoder", "fx"): {
        "refusal_says": [r"FX stops in net\.encoder \(BertModel\): \*args/\*\*kwargs forward",
                         r"\(route 1\.a\): modules=\[.*'net\.encoder\.encoder\.layer\.\*\.attention\.self\.query'"],
        "note": _HF_FX_NOTE.format(cls="BertModel", rest="attention's matmuls and softmax, the embeddings and the "
                                   "LayerNorms outside the output blocks", extra=": what the `minilm_qat` recipe "
                                   "quantizes on the pretrained all-MiniLM-L6-v2"),
    },
}


def route_in(message: str) -> Optional[list[str]]:
    """The ``modules=[...]`` list a refusal names as route 1.a (the parts that trace), or ``None``."""
    import ast

    found = re.search(r"\(route 1\.a\): modules=(\[[^\]]*\])", message)
    return ast.literal_eval(found.group(1)) if found else None

# Notes for rows that meet the targets but leave something out (shown in the README table).
NOTES: dict[tuple[str, str], str] = {
    **{(name, "fx"): "at the edge of the 99 % agreement target (int8 vs fake-quant 33-40 dB; KNOWN accepts either outcome)"
       for name in ("mobilenet_v2", "regnet_x_400mf")},
    ("resnet50", "pt2e"): "at the edge of the 99 % agreement target (int8 vs fake-quant 45-49 dB; KNOWN accepts either outcome)",
    # torch.ao FX keeps nn.MultiheadAttention a float leaf; the engine splits it (engines/fx/attention.py)
    ("vit_small_tv", "fx"): "nn.MultiheadAttention runs as four int8 Linear projections around a float attention core "
                            "(engine option split_attention); its matmuls and softmax stay float",
}


# ----------------------------------------------------------------------------------------- data


def digits_32(seed: int = 0) -> dict[str, TensorDataset]:
    """scikit-learn digits (8x8, 0..16) upsampled to 32x32, three channels, normalized; 1437/360 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False)
    x = ((x - 0.3) / 0.4).repeat(1, 3, 1, 1).contiguous()
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1437], order[1437:]
    return {"train": TensorDataset(x[train], y[train]), "test": TensorDataset(x[test], y[test])}


TOKEN_LEVELS = 17  # digits pixels are 0..16


def digits_tokens(seed: int = 0) -> dict[str, TensorDataset]:
    """scikit-learn digits as sequences of 64 token ids (each pixel's intensity, 0..16); the split of :func:`digits_32`."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1437], order[1437:]
    return {"train": TensorDataset(x[train], y[train]), "test": TensorDataset(x[test], y[test])}


def make_datamodule(batch_size: int, seed: int = 0, inputs: str = "images") -> Any:
    import lightning.pytorch as pl

    splits = digits_tokens(seed) if inputs == "tokens" else digits_32(seed)

    class Digits32(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(splits["train"], batch_size=batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(seed), drop_last=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(splits["test"], batch_size=64)

    return Digits32(), splits


# ----------------------------------------------------------------------------------------- one case


@dataclass
class CaseResult:
    model: str
    engine: str
    status: str  # works | below target | refused | not learned | error
    torch: str = torch.__version__
    sqnr_db: Optional[float] = None
    top1_agreement: Optional[float] = None
    samples: Optional[int] = None
    int8_accuracy: Optional[float] = None
    fake_quant_accuracy: Optional[float] = None
    float_ms_b1: Optional[float] = None
    int8_ms_b1: Optional[float] = None
    float_ms_b32: Optional[float] = None
    int8_ms_b32: Optional[float] = None
    auto_runtime: Optional[str] = None  # what lowering=auto keeps at batch 32, and float / it timed in blocks
    float_ms_auto_b32: Optional[float] = None
    auto_ms_b32: Optional[float] = None
    auto: dict = field(default_factory=dict)  # its candidates' latency, parity and why each was not kept
    options: dict = field(default_factory=dict)
    message: str = ""
    warnings: list = field(default_factory=list)
    fit_s: Optional[float] = None
    total_s: Optional[float] = None
    inductor_vs_int8_db: Optional[float] = None  # run_case(inductor_parity=True): the inductor candidate vs int8
    refusal: str = ""  # a ROUTES row: what prepare with modules=["net"] said, whose route the case then took

    def learned(self) -> bool:
        """Whether the fake-quant model is well above chance, so that comparing int8 to it means something."""
        return self.fake_quant_accuracy is not None and self.fake_quant_accuracy >= MIN_LEARNED_ACCURACY

    def meets_targets(self) -> bool:
        return (self.learned() and self.sqnr_db is not None and self.sqnr_db >= TARGET_SQNR_DB
                and self.top1_agreement is not None and self.top1_agreement >= TARGET_TOP1)


def _latency_ms(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall ms of each function, calls interleaved (benchmarks.timing): drift and neighbours' load hit float and
    int8 alike, so their ratio holds where 5 back-to-back calls each did not (stop 25: resnet18 read 1.4x, 2.3x
    interleaved)."""
    from benchmarks.timing import interleaved_medians, medians

    with torch.no_grad():
        return {k: 1000.0 * v for k, v in medians(interleaved_medians(fns, repeats, warmup=3, clock="wall")).items()}


def _lower_auto(result: CaseResult, qat: Any, int8: nn.Module, x: torch.Tensor, float_net: nn.Module, repeats: int) -> None:
    """What ``lowering="auto"`` ships at batch 32: the callback's own ``session.lower`` (every runtime built, checked
    against the fake-quant model on 128 held rows in batches of 32 and timed), then float eager and the kept runtime
    timed side by side in blocks (:func:`benchmarks.timing.blocked_medians`: runtimes' thread pools spin after a call)."""
    from benchmarks.timing import blocked_medians, medians
    from qlightning.core.inputs import Inputs

    held = [Inputs((x[i:i + 32],)) for i in range(0, 128, 32)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = qat.session.lower("net", int8, "auto", batch_size=32, parity_inputs=held, parity_source="held test digits")
    choice = qat.session.lowering_choices.get("net") or {}
    result.auto = {k: choice.get(k) for k in ("latency_ms", "sqnr_db", "top1_agreement", "errors", "first_call_s", "parity_on")}
    result.auto_runtime = choice.get("name")
    xb = x[:32]
    with torch.no_grad():
        ms = medians(blocked_medians({"float": lambda: float_net(xb), "auto": lambda: lowered(xb)}, repeats, clock="wall"))
    result.float_ms_auto_b32, result.auto_ms_b32 = 1000.0 * ms["float"], 1000.0 * ms["auto"]


def _with_fake_quant_targets(model: nn.Module, fake_quants: dict[str, nn.Module]) -> nn.Module:
    """A copy of ``model`` (int8 targets inside) whose targets are the callback's fake-quant copies (shared, only
    read), in eval mode."""
    import copy

    from qlightning.core.session import set_submodule

    copied = copy.deepcopy(model)
    for name, module in fake_quants.items():
        set_submodule(copied, name, module)
    return copied.eval()


def _whole_model_fidelity(result: CaseResult, fake_quant: nn.Module, int8: nn.Module, x: torch.Tensor) -> None:
    """SQNR and top-1 agreement of ``int8`` against ``fake_quant`` on ``x`` in batches of 64, as the gate reads them."""
    from qlightning.core.metrics import summed_sqnr_db, top1_agreement

    with torch.no_grad():
        pairs = [(fake_quant(x[i:i + 64]), int8(x[i:i + 64])) for i in range(0, len(x), 64)]
    result.sqnr_db = round(summed_sqnr_db(pairs), 2)
    agreement = top1_agreement(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
    result.top1_agreement = None if agreement is None else round(agreement, 4)
    result.samples = len(x)


def run_case(model_name: str, engine: str, *, max_steps: Optional[int] = None, batch_size: int = 32, seed: int = 0,
             latency: bool = False, latency_repeats: int = 15, inductor_parity: bool = False,
             modules: Optional[list[str]] = None) -> CaseResult:
    """Fit, convert and compare one model x engine; every failure is recorded, not raised. ``inductor_parity``: also
    compile the ``lowering=inductor`` candidate and record its SQNR against the int8 model on 128 held digits.
    ``modules``: the callback's targets (default ``["net"]``, the whole network; a :data:`ROUTES` row first tries that,
    then the modules list its refusal names)."""
    if modules is None and (model_name, engine) in ROUTES:
        refused = run_case(model_name, engine, max_steps=max_steps, batch_size=batch_size, seed=seed, modules=["net"])
        route = route_in(refused.message) if refused.status == "refused" else None
        if route is None:
            return refused  # not refused, or no route named: test_zoo says which
        result = run_case(model_name, engine, max_steps=max_steps, batch_size=batch_size, seed=seed, latency=latency,
                          latency_repeats=latency_repeats, inductor_parity=inductor_parity, modules=route)
        result.refusal = refused.message
        return result
    import lightning.pytorch as pl

    from qlightning import QuantizationAwareTraining
    from qlightning.examples.digits import ClassifierModule

    spec = MODELS[model_name]
    modules = modules or ["net"]
    whole = modules == ["net"]
    result = CaseResult(model=model_name, engine=engine, status="error",
                        options=dict(spec.options) if whole else {**spec.options, "modules": modules})
    started = time.perf_counter()
    pl.seed_everything(seed, verbose=False)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    net = spec.build()
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = BN_MOMENTUM
    max_steps = max_steps or spec.steps
    model = ClassifierModule(net, lr=spec.lr, scheduler="constant")
    model.example_input_array = (torch.zeros(2, 64, dtype=torch.long) if spec.inputs == "tokens"
                                 else torch.zeros(2, 3, 32, 32))
    dm, splits = make_datamodule(batch_size, seed, spec.inputs)
    # the callback's default schedule, as a user gets it: float for the first half (BatchNorm statistics from random
    # init need data, FIELD-NOTES), observers frozen for the last 15 %, BatchNorm never frozen (resnet50 frozen at
    # 7/8 of 96 steps at lr 3e-3: eval accuracy 93 % -> 20 % in the last 12 steps)
    qat = QuantizationAwareTraining(
        modules=modules, engine=engine,
        fidelity={"on_breach": "warn", "batches": 2, "min_sqnr_db": TARGET_SQNR_DB, "min_top1_agreement": TARGET_TOP1},
        **spec.options,
    )
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[qat], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         num_sanity_val_steps=0, limit_val_batches=2)
    float_net = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fit_start = time.perf_counter()
            trainer.fit(model, datamodule=dm)
            result.fit_s = time.perf_counter() - fit_start
        except Exception as exc:  # noqa: BLE001 - recorded: a refusal names what to change
            result.status = "refused" if type(exc).__name__ in ("ConfigError", "TraceError") else "error"
            result.message = f"{type(exc).__name__}: {exc}"[:1500]
    result.warnings = [str(w.message)[:2000] for w in caught
                       if issubclass(w.category, UserWarning) and "qlightning" in str(w.filename) + str(w.message)
                       or "fidelity" in str(w.message).lower()]
    if result.message:
        result.total_s = time.perf_counter() - started
        return result
    int8 = model.net
    x, y = splits["test"].tensors
    if whole:
        fid = qat.fidelity_results.get("net", {})
        result.sqnr_db = fid.get("sqnr_db")
        result.top1_agreement = fid.get("top1_agreement")
        result.samples = fid.get("samples")
        if fid.get("error"):
            result.message = str(fid["error"])[:1500]
        fake_quant = qat.fake_quant_modules.get("net")
    else:  # the whole network's output, its targets int8 against the same network with their fake-quant copies
        model.eval()  # the float parts too (dropout)
        fake_quant = _with_fake_quant_targets(model, qat.fake_quant_modules).net
        _whole_model_fidelity(result, fake_quant, int8, x[:128])
    try:
        with torch.no_grad():
            result.int8_accuracy = float((int8(x[:256]).argmax(1) == y[:256]).float().mean())
            if fake_quant is not None:
                result.fake_quant_accuracy = float((fake_quant(x[:256]).argmax(1) == y[:256]).float().mean())
    except Exception as exc:  # noqa: BLE001
        result.message = result.message or f"int8 forward: {type(exc).__name__}: {exc}"[:1500]
    if inductor_parity and fake_quant is not None and not result.message:
        from qlightning.core.inputs import Inputs
        from qlightning.quantize.lowering import LoweringContext, _build_inductor
        from qlightning.run.parity import sqnr_db

        inductor = _build_inductor(LoweringContext(fake_quant, int8, Inputs((x[:32],))))
        with torch.no_grad():
            expected = torch.cat([int8(x[i:i + 32]) for i in range(0, 128, 32)])
            got = torch.cat([inductor(x[i:i + 32]) for i in range(0, 128, 32)])
        result.inductor_vs_int8_db = round(float(sqnr_db(expected, got)), 2)
    if latency and not result.message:
        float_net = spec.build().eval()  # latency does not depend on the weights
        for b, attr in ((1, "b1"), (32, "b32")):
            xb = x[:b]
            ms = _latency_ms({"float": lambda: float_net(xb), "int8": lambda: int8(xb)}, latency_repeats)
            setattr(result, f"float_ms_{attr}", ms["float"])
            setattr(result, f"int8_ms_{attr}", ms["int8"])
        if fake_quant is not None and whole:  # lowering=auto lowers each target: here the whole network only
            _lower_auto(result, qat, int8, x, float_net, latency_repeats)
    if result.message:
        result.status = "error"
    elif not result.learned():
        result.status = "not learned"
        result.message = (f"the fake-quant model is at {result.fake_quant_accuracy} accuracy after {max_steps} steps "
                          f"(< {MIN_LEARNED_ACCURACY}): int8 vs fake-quant would compare near-constant outputs")
    elif result.meets_targets():
        result.status = "works"
    else:
        result.status = "below target"
    result.total_s = time.perf_counter() - started
    return result
