"""What a rank does around each module under a communication schedule, read off its table (b_n, s_n, a_n).

Torch-free. The schedule (`models.schedules.grammar.Schedule`) says, per module n, when this rank's own
partial enters its stream (b_n, scaled by s_n) and when the other ranks' partials do (a_n). The
partials that arrive at the same point t travel as one exchange: the all-reduce of their sum, started
as soon as the last of them is computed and waited for only before module t. So, for every preset:

    tp        each module's all-reduce waited at once (the blocking all-reduce of tensor parallelism)
    dtp:δ     each module's exchange started at once and waited δ modules later; √L on the own partial
              of the first and last δ modules, the last δ never exchanged
    dtp:δ@K   tp below the converted upper K layers, dtp:δ within them
    ladder    each module's all-reduce started at once and waited one module later (own output late too)
    spd:B     at a dropped layer the attention's partial rides with its FFN's: one exchange of their sum
    pt:D      one exchange per block of D layers (the sum of the block's partials), waited at its end

Nothing here is per preset: `ArrivalPlan.of(schedule)` derives it all from the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.schedules.grammar import Schedule

__all__ = ["Arrival", "ArrivalPlan"]


@dataclass(frozen=True)
class Arrival:
    """The additions to a rank's stream before module t (t = M: before the final norm)."""

    own: tuple[tuple[int, float], ...]  # (m, s_m) for the own partials with b_m = t, added alone
    exchange: bool  # an exchange (of the modules with a_m = t) is waited for here
    whole: bool  # ... and its every module also has b_m = t, s_m = 1: add the sum over ranks as it is


@dataclass(frozen=True)
class ArrivalPlan:
    num_modules: int
    others_due: tuple[int | None, ...]  # per module n: a_n, the exchange its partial joins (None: never sent)
    sends: tuple[int | None, ...]  # per module n: the arrival point whose exchange starts right after n
    members: tuple[tuple[int, ...], ...]  # per arrival point t = 0 .. M: the modules its exchange sums
    arrivals: tuple[Arrival, ...]  # before module n+1 (index n): what enters the stream there
    own_done: tuple[tuple[int, ...], ...]  # index n: own partials no longer needed after arrival n+1

    @classmethod
    def of(cls, schedule: Schedule) -> ArrivalPlan:
        M = schedule.num_modules
        members = tuple(schedule.others_arriving(t) for t in range(M + 1))
        sends: list[int | None] = [None] * M
        for t, group in enumerate(members):
            if group:
                sends[max(group)] = t  # the exchange can start once its last module is computed
        arrivals = []
        for t in range(1, M + 1):
            group = members[t]
            whole = bool(group) and all(schedule.own_arrival[m] == t and schedule.own_scale[m] == 1.0
                                        for m in group)
            own = tuple((m, schedule.own_scale[m]) for m in schedule.own_arriving(t) if not (whole and m in group))
            arrivals.append(Arrival(own, bool(group), whole))
        done = tuple(schedule.own_arriving(t) for t in range(1, M + 1))
        return cls(M, schedule.other_arrival, tuple(sends), members, tuple(arrivals), done)

    @property
    def exchanges(self) -> int:
        """Exchanges per forward (the schedule's syncs per token)."""
        return sum(1 for group in self.members if group)
