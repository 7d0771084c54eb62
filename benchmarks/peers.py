"""The QAT train step of other QAT libraries beside qlightning's and torch.ao's, in one interleaved run.

Each peer is set up as its own documentation shows for quantization-aware training on CPU, int8 weights and
activations, calibrated on the same 4 batches, then trained (forward + cross-entropy + backward + Adam, as
:func:`benchmarks.suites.train_step`). A peer that is not installed, or that fails on a model, is recorded with
its error instead of a figure. The peers differ in what their training step computes; ``SEMANTICS`` says how
(:func:`describe` records what moves in a training step; the rest was read from each library's modules), so that
a ratio is read beside it.

Install them with the ``bench`` extra (``pip install -e ".[all,bench]"``); NNCF compiles a C++ extension on
its first use (about a minute, cached under ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
from typing import Any, Callable, Optional

import torch
from torch import nn

from benchmarks.models import ModelSpec
from benchmarks.suites import (QAT_FROZEN, QAT_ON, _log, _step_figures, quiet, qlightning_prepare, set_phase,
                               torchao_fx_prepare, train_step)
from benchmarks.timing import interleaved_medians

#: what each variant's training step does, as its library sets it up by default (see :func:`describe`)
SEMANTICS = {
    "torch.ao FX": "conv-bn fused with BN folded into the weight each step; per-channel weights; observers update every step",
    "qlightning FX": "as torch.ao FX (the default's observing phase)",
    "qlightning FX, frozen": "as torch.ao FX with observers and BatchNorm statistics frozen (the default's last 15 %)",
    "torchao PT2E by hand": "torch.export + prepare_qat_pt2e with X86InductorQuantizer's QAT config",
    "NNCF": "nncf.quantize: BatchNorm kept apart from the conv (not folded); quantizer scales are trained parameters",
    "Brevitas": "brevitas.graph quantize after preprocess_for_quantize, which merges BatchNorm into the conv first "
                "(no BatchNorm in training); weight scales from the weights each step, activation scales trained",
    "ModelOpt": "mtq.quantize with INT8_DEFAULT_CFG: BatchNorm kept apart (not folded); ranges (amax) fixed by "
                "calibration, not updated in training",
}
PEERS = ("torchao PT2E by hand", "NNCF", "Brevitas", "ModelOpt")
DISTRIBUTIONS = {"NNCF": "nncf", "Brevitas": "brevitas", "ModelOpt": "nvidia-modelopt", "torchao PT2E by hand": "torchao"}


def _calibrate(model: nn.Module, batches: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for batch in batches:
            model(batch)


def torchao_pt2e_by_hand(model: nn.Module, x: torch.Tensor, calib: list[torch.Tensor]) -> nn.Module:
    from torchao.quantization.pt2e import allow_exported_model_train_eval, move_exported_model_to_train
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer, get_default_x86_inductor_quantization_config)

    exported = torch.export.export(model.train(), (x,)).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=True))
    prepared = prepare_qat_pt2e(exported, quantizer)
    move_exported_model_to_train(prepared)
    allow_exported_model_train_eval(prepared)  # the benchmark's step calls .train(), as a training loop does
    _calibrate(prepared, [x])  # exported at the training batch: the calibration batches would not match its shape
    return prepared


def nncf_qat(model: nn.Module, x: torch.Tensor, calib: list[torch.Tensor]) -> nn.Module:
    import nncf

    os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")  # its first use compiles; a busy 2-core CPU took 75 s
    # subset_size counts the dataset's items, here batches
    return nncf.quantize(model.eval(), nncf.Dataset(calib), subset_size=len(calib)).train()


def brevitas_qat(model: nn.Module, x: torch.Tensor, calib: list[torch.Tensor]) -> nn.Module:
    from brevitas.graph.calibrate import calibration_mode
    from brevitas.graph.quantize import preprocess_for_quantize, quantize

    quantized = quantize(preprocess_for_quantize(model.eval()))
    with calibration_mode(quantized):
        _calibrate(quantized, calib)
    return quantized.train()


def modelopt_qat(model: nn.Module, x: torch.Tensor, calib: list[torch.Tensor]) -> nn.Module:
    import modelopt.torch.quantization as mtq

    model.train()  # calibrated on training-mode activations (BatchNorm on batch statistics), as they are trained
    return mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: _calibrate(m, calib)).train()


BUILDERS: dict[str, Callable[[nn.Module, torch.Tensor, list[torch.Tensor]], nn.Module]] = {
    "torchao PT2E by hand": torchao_pt2e_by_hand,
    "NNCF": nncf_qat,
    "Brevitas": brevitas_qat,
    "ModelOpt": modelopt_qat,
}


def version(peer: str) -> Optional[str]:
    try:
        return importlib.metadata.version(DISTRIBUTIONS[peer])
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(model: nn.Module, float_model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Which of ``model``'s tensors beyond the float model's (quantizer scales, observer buffers) three training steps
    move, and which of them are trained parameters. (An output SQNR against the float model says little here:
    BatchNorm folded, merged or frozen differs from float by more than the quantization does.)"""
    model = copy.deepcopy(model)
    float_names = {n.split(".")[-1] for n, _ in float_model.named_parameters()} | {"running_mean", "running_var",
                                                                                   "num_batches_tracked"}
    before = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
              if n.split(".")[-1] not in float_names and t.is_floating_point()}
    step = train_step(model, x, y)
    for _ in range(3):
        step()
    state = dict([*model.named_parameters(), *model.named_buffers()])
    moved = sorted({n.rsplit(".", 1)[-1] for n, t in before.items() if n in state and not torch.equal(state[n], t)})
    trained = sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if n in before and p.requires_grad})
    return {"quantizer_tensors_moved": moved, "quantizer_parameters_trained": trained}


def peer_step_ratios(spec: ModelSpec, repeats: int, clock: str, peers: tuple[str, ...] = PEERS) -> dict[str, Any]:
    """QAT train step / float train step for qlightning, torch.ao and each installed peer, in one interleaved run."""
    torch.manual_seed(0)
    float_model = spec.build()
    x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
    calib = [spec.inputs(spec.train_batch, seed=s) for s in range(1, 5)]
    variants: dict[str, nn.Module] = {"float": float_model}
    variants["torch.ao FX"] = set_phase(torchao_fx_prepare(copy.deepcopy(float_model), x[:1]), QAT_ON)
    variants["qlightning FX"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), x[:1]), QAT_ON)
    frozen = set_phase(qlightning_prepare(copy.deepcopy(float_model), x[:1]), QAT_ON)
    _calibrate(frozen, calib)
    variants["qlightning FX, frozen"] = set_phase(frozen, QAT_FROZEN)
    errors: dict[str, str] = {}
    for peer in peers:
        if version(peer) is None:
            errors[peer] = f"not installed (pip install {DISTRIBUTIONS[peer]}, or the bench extra)"
            continue
        try:
            with quiet():
                variants[peer] = BUILDERS[peer](copy.deepcopy(float_model), x, calib)
        except Exception as exc:  # a peer that cannot take this model is a finding, not a crash
            errors[peer] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            _log(f"{spec.name}: {peer} failed: {errors[peer]}")
    described = {}
    for name, module in variants.items():
        if name != "float":
            with quiet():
                described[name] = describe(module, float_model, x, y)
    fns = {name: train_step(m, x, y) for name, m in variants.items()}
    with quiet():
        figures = _step_figures(spec, interleaved_medians(fns, repeats, warmup=3, clock=clock), repeats)
    figures["errors"] = errors
    figures["described"] = described
    return figures


def run(models: list[str], repeats: Optional[int], clock: str) -> dict[str, Any]:
    from benchmarks.models import model_spec

    out: dict[str, Any] = {"versions": {p: version(p) for p in PEERS}, "semantics": SEMANTICS, "models": {}}
    for name in models:
        spec = model_spec(name)
        n = repeats or (100 if name == "digits_cnn" else 20)
        _log(f"{name}: peers' QAT steps ({n} repeats)")
        out["models"][name] = {"title": spec.title, **peer_step_ratios(spec, n, clock)}
    return out
