"""What whole-model quantization did (q4torch.replace_linear, q4jax.quantize_model):
every layer quantized, and every weight-bearing layer or float matrix parameter left
float with the reason. One definition for both front ends."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

# reasons a caller asked for; anything else is a layer the library could not take
SKIP_RULE = "skip rule"
EMBEDDINGS_OFF = "embeddings=False"
_DELIBERATE = (SKIP_RULE, EMBEDDINGS_OFF)


@dataclass(frozen=True)
class ReportRow:
    path: str  # the layer's (or parameter's) dotted path, torch-style
    layer: str  # the float layer's class
    detail: str  # quantized: what it became; left float: why


@dataclass
class QuantizeReport:
    """``quantized``: (path, float class, what it became); ``left_float``: (path,
    class, why) for every weight-bearing layer or float parameter of two or more
    axes the call did not quantize."""

    quantized: list[ReportRow] = field(default_factory=list)
    left_float: list[ReportRow] = field(default_factory=list)

    @property
    def unasked(self) -> list[ReportRow]:
        """The rows left float for a reason other than a skip rule or embeddings=False."""
        return [r for r in self.left_float if r.detail not in _DELIBERATE]

    def __str__(self) -> str:
        lines = [f"quantized {len(self.quantized)} layers, left {len(self.left_float)} float"]
        lines += [f"  quantized  {r.path}: {r.layer} -> {r.detail}" for r in self.quantized]
        lines += [f"  float      {r.path}: {r.layer} ({r.detail})" for r in self.left_float]
        return "\n".join(lines)

    def log_left_float(self, logger: logging.Logger, who: str) -> None:
        """Each row left float: INFO where the caller asked for it, WARNING otherwise."""
        for r in self.left_float:
            level = logging.INFO if r.detail in _DELIBERATE else logging.WARNING
            logger.log(level, "%s: kept %s float: %s (%s)", who, r.path, r.layer, r.detail)

    def check_strict(self, who: str, advice: str) -> None:
        """strict=True: a ValueError naming every row left float that no option asked for."""
        if self.unasked:
            rows = "; ".join(f"{r.path} ({r.layer}: {r.detail})" for r in self.unasked)
            raise ValueError(
                f"{who}(strict=True): left float: {rows}. {advice}; skip=... leaves a layer float on purpose"
            )
