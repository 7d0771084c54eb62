"""The FX engine's faster prepare (qlightning/engines/fx_prepare.py) builds the same model as torch.ao.

It only skips observers torch.ao constructs to inspect and throws away; so the prepared graph, every
module, every qconfig, the state and the converted int8 model must be the same with and without it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, QConfig, default_weight_fake_quant

from qlightning import Inputs, Phase, QuantSpec, get_engine
from qlightning.engines.fx.prepare import faster_prepare
from qlightning.examples.digits import DigitsCNN


class MixedNet(nn.Module):
    """conv-bn-relu, a residual add, a fixed-qparams op (sigmoid), a float head and a narrow-range conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.narrow = nn.Conv2d(8, 8, 3, padding=1)
        self.body = nn.Sequential(nn.Linear(8 * 8 * 8, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.sigmoid(self.narrow(x)) + x
        return self.head(self.body(torch.flatten(x, 1)))


def _mixed_mapping(is_qat: bool):
    from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping

    mapping = get_default_qat_qconfig_mapping("x86") if is_qat else get_default_qconfig_mapping("x86")
    four_bit = QConfig(
        activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=15),
        weight=default_weight_fake_quant,
    )
    return mapping.set_module_name("head", None).set_module_name("narrow", four_bit)


CASES = {
    "digits_qat_x86": (DigitsCNN, "x86", True, None),
    "digits_ptq_qnnpack": (DigitsCNN, "qnnpack", False, None),
    "mixed_qat": (MixedNet, "x86", True, _mixed_mapping),
    "mixed_ptq": (MixedNet, "fbgemm", False, _mixed_mapping),
}


def _prepare(case: str, fast: bool) -> nn.Module:
    cls, backend, is_qat, mapping = CASES[case]
    torch.manual_seed(0)
    spec = QuantSpec(backend=backend, is_qat=is_qat, qconfig_mapping=mapping(is_qat) if mapping else None,
                     options={"fast_prepare": fast, "fast_qat": False})
    return get_engine("fx").prepare(cls(), Inputs((torch.randn(2, 1, 8, 8),)), spec)


def _qconfig_views(model: nn.Module) -> dict[str, tuple[str, str]]:
    views = {}
    for name, module in model.named_modules():
        qconfig = getattr(module, "qconfig", None)
        if qconfig is not None:
            views[name] = tuple(repr(ctor()) if ctor is not None else "None" for ctor in (qconfig.activation, qconfig.weight))
    return views


@pytest.mark.parametrize("case", sorted(CASES))
def test_faster_prepare_builds_the_same_model(case):
    fast, stock = _prepare(case, True), _prepare(case, False)
    assert fast.code == stock.code
    assert repr(fast) == repr(stock)
    assert _qconfig_views(fast) == _qconfig_views(stock)
    fast_state, stock_state = fast.state_dict(), stock.state_dict()
    assert list(fast_state) == list(stock_state)
    assert all(torch.equal(fast_state[k], stock_state[k]) for k in fast_state)

    # calibrate / train both the same way, convert, and compare the int8 models' outputs
    _, backend, is_qat, _ = CASES[case]
    engine = get_engine("fx")
    x = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for model in (fast, stock):
        engine.set_phase(model, Phase(fake_quant=True, observe=True, bn_frozen=False))
        model.train(is_qat)
        with torch.no_grad():
            model(x)
    spec = QuantSpec(backend=backend, is_qat=is_qat)
    int8_fast, int8_stock = engine.convert(fast, spec), engine.convert(stock, spec)
    assert int8_fast.code == int8_stock.code
    with torch.no_grad():
        assert torch.equal(int8_fast(x), int8_stock(x))


def test_faster_prepare_puts_torch_ao_back_even_on_error():
    names = {
        "torch.ao.quantization.fx.qconfig_mapping_utils": "_add_module_to_qconfig_obs_ctr",
        "torch.ao.quantization.quantize": "_add_module_to_qconfig_obs_ctr",
        "torch.ao.quantization.fx.prepare": "_qconfig_satisfies_dtype_config_constraints",
        "torch.ao.quantization.utils": "get_qconfig_dtypes",
        "torch.fx.config": "do_not_emit_stack_traces",
    }
    before = {mod: getattr(importlib.import_module(mod), attr) for mod, attr in names.items()}
    with pytest.raises(RuntimeError, match="boom"):
        with faster_prepare():
            assert all(getattr(importlib.import_module(m), a) is not before[m] for m, a in names.items())
            raise RuntimeError("boom")
    assert all(getattr(importlib.import_module(m), a) is before[m] for m, a in names.items())



_FIRST_PREPARE = """
import sys, torch
import lightning.pytorch
import qlightning
from qlightning import Inputs, QuantSpec, get_engine
from qlightning.examples.digits import DigitsCNN
HEAVY = ("torch._functorch.aot_autograd", "torch.export._trace")
already = [m for m in HEAVY if m in sys.modules]
get_engine("fx").prepare(DigitsCNN(), Inputs((torch.randn(2, 1, 8, 8),)), QuantSpec(backend="x86", is_qat=True))
print("ALREADY", already)
print("LOADED", [m for m in HEAVY if m in sys.modules and m not in already])
"""


def test_a_first_prepare_in_a_process_does_not_import_torch_export():
    # torch.ao's tracer recorded each node's stack, and its frame filter imports torch.export and
    # aot_autograd: 0.23-0.35 s of the digits CNN's first prepare on an AVX2 EPYC, where a 3-epoch digits
    # fit takes 1.2-1.3 s in float
    out = subprocess.run([sys.executable, "-c", _FIRST_PREPARE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("ALREADY", "LOADED")))
    if lines["ALREADY"] != "[]":
        pytest.skip(f"imported before the prepare: {lines['ALREADY']}")
    assert lines["LOADED"] == "[]"
