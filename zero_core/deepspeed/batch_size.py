"""A DeepSpeed config's ``train_batch_size``: the global batch, micro-batch x accumulation x data-parallel ranks.

DeepSpeed derives whichever of the three the config leaves out (``DeepSpeedConfig._set_batch_related_parameters``)
and refuses a config whose three numbers disagree (``_batch_assertion``). Here the framework owns the micro-batch
(the DataLoader's batch size) and the accumulation (its own argument), so each adapter resolves the batch once it
knows the ranks, with the numbers it has: the config's, or the framework's where the config says nothing. What
DeepSpeed would derive, the adapter then makes the framework's (the accumulation), or checks against what the
framework does (the DataLoader's batch size) when it first sees it. Nothing here is silently dropped: a global
batch other than the config's is refused, naming the numbers and the fix.

DeepSpeed's rule, with T the global batch, M the micro-batch, G the accumulation and W the data-parallel ranks:
M and G given: T must be M x G x W; M given: G = T / (M x W); G given: M = T / (G x W); neither: G = 1 and
M = T / W. DeepSpeed floors the divisions and then refuses the product that misses T; here a division that is not
exact is refused at once, with the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GlobalBatch:
    """The batch a config's ``train_batch_size`` asks for, resolved: ``train_batch = micro x accumulation x ranks``."""

    train_batch: int
    micro_batch: int
    accumulation: int
    ranks: int
    source: str  # the config file (or "the DeepSpeed config" for a dict), for the messages
    micro_given: bool  # False: derived from the others, so the DataLoader's batch size must be it

    def check_micro_batch(self, observed: int | None, where: str) -> None:
        """The DataLoader's batch size (per rank), once the adapter sees it, must be the micro-batch resolved;
        ``observed`` None: the loader states no batch size, so the config must name the micro-batch."""
        if observed is None:
            if not self.micro_given:
                raise ValueError(
                    f"{self.source}: train_batch_size={self.train_batch} needs the micro-batch, and {where} has no "
                    f"batch_size to read it from: set train_micro_batch_size_per_gpu={self.micro_batch} in the config "
                    "(the micro-batch your loader yields), or remove train_batch_size."
                )
            return
        if observed != self.micro_batch:
            raise ValueError(
                f"{self.source}: train_batch_size={self.train_batch} = micro-batch {self.micro_batch} x "
                f"{self.accumulation} accumulated x {self.ranks} data-parallel ranks, but {where} yields batches of "
                f"{observed} per rank, a global batch of {observed * self.accumulation * self.ranks}: give the "
                f"loader batch_size={self.micro_batch}, or set train_micro_batch_size_per_gpu={observed} and "
                "train_batch_size to match (or remove train_batch_size)."
            )


def resolve_global_batch(
    source: str,
    train_batch: int | None,
    micro_batch: int | None,
    accumulation: int | None,
    ranks: int,
    accumulation_name: str = "gradient_accumulation_steps",
) -> GlobalBatch | None:
    """DeepSpeed's rule over what is known (None: not given); None when the config sets no ``train_batch_size``
    (then the DataLoader and the framework decide, as under DeepSpeed, which only reports the micro-batch).
    ``accumulation_name``: where a given accumulation came from, in the messages (the config's key, or the
    framework's argument)."""
    if train_batch is None:
        return None
    if micro_batch is not None and accumulation is not None:
        if micro_batch * accumulation * ranks != train_batch:
            raise ValueError(
                f"{source}: train_batch_size={train_batch} is not train_micro_batch_size_per_gpu={micro_batch} x "
                f"{accumulation_name}={accumulation} x {ranks} data-parallel ranks = "
                f"{micro_batch * accumulation * ranks} (DeepSpeed refuses this config too): set train_batch_size="
                f"{micro_batch * accumulation * ranks}, or change the micro-batch or the accumulation to match, or "
                "remove train_batch_size."
            )
        return GlobalBatch(train_batch, micro_batch, accumulation, ranks, source, micro_given=True)
    if micro_batch is not None:
        return GlobalBatch(
            train_batch, micro_batch, _divide(source, train_batch, micro_batch, ranks, "micro"), ranks, source, True
        )
    accumulation = 1 if accumulation is None else accumulation  # DeepSpeed's default where both are left out
    micro = _divide(source, train_batch, accumulation, ranks, "accumulation")
    return GlobalBatch(train_batch, micro, accumulation, ranks, source, micro_given=False)


def _divide(source: str, train_batch: int, known: int, ranks: int, which: str) -> int:
    """``train_batch / (known x ranks)``, which must be a whole number >= 1."""
    quotient, remainder = divmod(train_batch, known * ranks)
    if remainder == 0 and quotient >= 1:
        return quotient
    if which == "micro":
        given, wanted, fix = f"train_micro_batch_size_per_gpu={known}", "gradient_accumulation_steps", "micro-batch"
    else:
        given, wanted, fix = f"{known} micro-batch(es) accumulated", "train_micro_batch_size_per_gpu", "accumulation"
    raise ValueError(
        f"{source}: train_batch_size={train_batch} is not a whole multiple of {given} x {ranks} data-parallel ranks, "
        f"so no {wanted} makes it: set train_batch_size to a multiple of {known * ranks}, or change the {fix}, "
        "or remove train_batch_size."
    )
