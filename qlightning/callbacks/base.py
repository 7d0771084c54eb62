"""What the QAT and PTQ callbacks share: argument checks, the session they adapt, its attributes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from qlightning.core.fidelity import ModuleFidelity, breach_message
from qlightning.core.session import QuantSession
from qlightning.engines import BACKENDS, ENGINES, QuantEngine, get_engine


def check_common_arguments(modules: Any, backend: str, engine: Any, errors: list[str]) -> list[str]:
    """The checks QAT and PTQ callbacks share: module names, backend, engine. Returns the names.

    Args:
        modules: the ``modules`` argument (a name, a pattern, or a list of them).
        backend: the ``backend`` argument.
        engine: the ``engine`` argument (a name or an instance).
        errors: where a message per problem is appended.
    """
    names = [modules] if isinstance(modules, str) else list(modules)
    if not names or not all(isinstance(n, str) and n for n in names):
        errors.append(f"modules={modules!r}: give one or more submodule names, e.g. ['net']")
    if backend not in BACKENDS:
        errors.append(f"backend={backend!r}: unknown backend; valid choices: {list(BACKENDS)}")
    elif backend not in torch.backends.quantized.supported_engines:
        errors.append(
            f"backend={backend!r}: not available in this torch build; available: "
            f"{[b for b in BACKENDS if b in torch.backends.quantized.supported_engines]}"
        )
    if isinstance(engine, str) and engine not in ENGINES:
        errors.append(f"engine={engine!r}: unknown engine; valid choices: {list(ENGINES)}")
    return names


def _delegated(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(self.session, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self.session, name, value)

    return property(get, set_, doc=f"The session's ``{name}`` (see :class:`~qlightning.core.session.QuantSession`).")


class SessionCallback:
    """Mixin of a callback that adapts a :class:`QuantSession`: the engine, and the session's state as attributes.

    The engine is resolved on first use, so constructing a callback never imports torch.ao or torchao.
    """

    session: QuantSession
    _engine_arg: Any
    _engine: Optional[QuantEngine]

    def _record_comparison(self, result: ModuleFidelity, breaches: list[ModuleFidelity], breached: bool) -> None:
        """One module's gate result: kept in ``fidelity_results``, logged, collected when it breached."""
        if breached:
            breaches.append(result)
        self.fidelity_results[result.module] = result.to_dict()
        rank_zero_info(f"[qlightning] fidelity {result.describe()}")

    def _conclude_gate(self, breaches: list[ModuleFidelity], reference: str, fallback: str) -> None:
        """After every module was compared: raise (on_breach='fail'), or warn loudly and record the notice."""
        if not breaches:
            return
        message = breach_message(type(self).__name__, reference, breaches, self.fidelity, fallback=fallback)
        self.notices.append(message)
        rank_zero_warn(f"[qlightning] {message}")

    def _say_engine_notes(self, spec: Any = None) -> None:
        """Log what the engine chose for the spec (:meth:`QuantEngine.notes`), once; its warnings become notices."""
        if self.session.engine_notes:
            return
        for warning, text in self.engine.notes(spec if spec is not None else self.spec):
            self.session.engine_notes.append(text)
            if warning:
                self.notices.append(text)
                rank_zero_warn(f"[qlightning] {text}")
            else:
                rank_zero_info(f"[qlightning] {text}")

    @property
    def engine(self) -> QuantEngine:
        if self._engine is None:
            self._engine = get_engine(self._engine_arg)
        self.session.engine = self._engine
        return self._engine

    @property
    def spec(self) -> Any:
        return self.session.spec

    @spec.setter
    def spec(self, value: Any) -> None:
        self.session.spec = value

    def export_limits(self) -> dict[str, str]:
        """The exports (``onnx``, ``pt2``) and the q/dq ``reference`` the quantized modules cannot have, with why."""
        self.engine  # resolved on first use
        return self.session.export_limits()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(modules=tuple(self.module_names), backend=self.backend)  # type: ignore[attr-defined]

    targets = _delegated("targets")
    inputs = _delegated("inputs")
    prepared = _delegated("prepared")
    converted = _delegated("converted")
    phase = _delegated("phase")
    fake_quant_modules = _delegated("fake_quant_modules")
    int8_modules = _delegated("int8_modules")
    lowering_choices = _delegated("lowering_choices")
    ptq_modules = _delegated("ptq_modules")
    float_snapshot = _delegated("float_snapshot")
    float_modules = _delegated("float_modules")
    provenance = _delegated("provenance")
    fidelity_results = _delegated("fidelity_results")
    notices = _delegated("notices")
