"""A layout comparison: which layouts, on what data, at which L and δ, with which seeds and recipe."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.data.calibration import CalibrationSpec
from models.distill.recipe import DistillError, DistillRecipe
from models.schedules.grammar import ScheduleSpec, shorthand


@dataclass(frozen=True, kw_only=True)
class DistillSpec:
    """A layout comparison: every (layout, seed) pair is one run of the same recipe.

    layouts: names in the grammar of `models.layouts.names` (optimised and ablations from a layouts
    directory, `contiguous`, `random-<seed>` / `random:<seed>`, or a dtp-layout/1 JSON path).
    """

    layouts: tuple[str, ...]
    train: CalibrationSpec
    eval: CalibrationSpec
    devices: int
    # The communication schedule every student simulates, parsed at the boundary (the job spec, the flags)
    schedule: ScheduleSpec
    delta: int = 1  # the layouts' δ (a dtp schedule's own)
    seeds: tuple[int, ...] = (0,)
    recipe: DistillRecipe = field(default_factory=DistillRecipe)
    reference: str = "contiguous"  # the headline compares `candidate` against `reference`
    candidate: str = "optimised"
    # The calibration the layouts were optimised on (and its identity as recorded then): training
    # skips its blocks where it shares their text, unless allow_overlap (see models.data.heldout).
    calibration: CalibrationSpec | None = None
    calibration_identity: str | None = None
    allow_overlap: bool = False
    world_size: int = 1  # ranks each run trains on (models.distill.sharding); the curves do not depend on it

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleSpec):
            raise DistillError(f"schedule: a ScheduleSpec (parsed where the spec is read), got "
                               f"{type(self.schedule).__name__}")
        if not self.schedule.resolvable:
            raise DistillError(f"schedule: {self.schedule} chooses its layers from calibration data (not available "
                               "yet); give them as spd:B")
        object.__setattr__(self, "layouts", tuple(self.layouts))
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        if not self.layouts:
            raise DistillError("layouts: give at least one layout")
        if len(set(self.layouts)) != len(self.layouts):
            raise DistillError(f"layouts: duplicates in {', '.join(self.layouts)}")
        if self.world_size < 1 or self.recipe.batch_size % self.world_size:
            raise DistillError(f"world_size must be a positive divisor of recipe.batch_size={self.recipe.batch_size} "
                               f"(each rank takes an equal share of every batch), got {self.world_size}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise DistillError(f"seeds: give distinct integers, got {list(self.seeds)}")

    @property
    def run_schedule(self) -> ScheduleSpec | None:
        """The schedule as each (layout, seed) run takes it (`models.distill.run`): None for dtp:δ of the layouts'
        δ (the runs' default), else the spec."""
        return None if shorthand(self.schedule, self.delta) is None else self.schedule
