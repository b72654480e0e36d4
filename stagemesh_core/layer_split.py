"""Layer split: which contiguous slice of the decoder layers each pipeline stage owns.

Pure functions, no MLX and no Ray, so placement can be previewed and tested with
plain values. A split is a tuple of half-open ``(start, end)`` ranges that tile
``[0, num_layers)`` in stage order. The default split is contiguous and even;
when the layers do not divide evenly the earliest stages take one extra each
(30 layers over 4 stages: 8, 8, 7, 7).

``parse_layer_split`` turns the ``--pp-layer-split`` flag (cumulative boundaries,
``10,20`` for three stages over 30 layers) into a split and rejects anything that
does not tile the model, naming the flag and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagemesh_core.errors import UserError


class LayerSplitError(UserError):
    """A requested split cannot serve the model; the message says what to change."""


@dataclass(frozen=True)
class LayerRange:
    """Half-open range of global decoder-layer indices owned by one stage."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def as_range(self) -> range:
        return range(self.start, self.end)

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def even_split(num_layers: int, num_stages: int) -> tuple[LayerRange, ...]:
    """Contiguous split with sizes differing by at most one; earlier stages take the remainder."""
    if num_stages < 1:
        raise LayerSplitError(
            f"--pipeline-parallel-size must be at least 1, got {num_stages}."
        )
    if num_stages > num_layers:
        raise LayerSplitError(
            f"--pipeline-parallel-size {num_stages} exceeds the model's {num_layers} "
            f"decoder layers; every stage needs at least one layer. "
            f"Use --pipeline-parallel-size {num_layers} or fewer."
        )
    base, extra = divmod(num_layers, num_stages)
    ranges = []
    start = 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(LayerRange(start, start + size))
        start += size
    return tuple(ranges)


def parse_layer_split(
    spec: str, num_layers: int, num_stages: int
) -> tuple[LayerRange, ...]:
    """Parse ``--pp-layer-split`` boundaries (e.g. ``10,20``) into stage ranges.

    The flag lists the first layer of every stage after the first, so it holds
    ``num_stages - 1`` strictly increasing integers inside ``(0, num_layers)``.
    """
    text = spec.strip()
    parts = [p.strip() for p in text.split(",")] if text else []
    try:
        bounds = [int(p) for p in parts]
    except ValueError:
        raise LayerSplitError(
            f"--pp-layer-split {spec!r} must be comma-separated integers, the first "
            f"layer of each stage after the first (e.g. '10,20' for 3 stages)."
        ) from None
    if len(bounds) != num_stages - 1:
        raise LayerSplitError(
            f"--pp-layer-split {spec!r} gives {len(bounds)} boundaries, but "
            f"--pipeline-parallel-size {num_stages} needs exactly {num_stages - 1} "
            f"(the first layer of each stage after the first)."
        )
    edges = [0, *bounds, num_layers]
    for left, right in zip(edges, edges[1:]):
        if right <= left:
            raise LayerSplitError(
                f"--pp-layer-split {spec!r} is not strictly increasing inside "
                f"(0, {num_layers}): every stage needs at least one of the model's "
                f"{num_layers} layers."
            )
    return tuple(LayerRange(a, b) for a, b in zip(edges, edges[1:]))


def plan_layer_split(
    num_layers: int, num_stages: int, explicit: str | None = None
) -> tuple[LayerRange, ...]:
    """The split to use: the explicit flag when given, else the even split."""
    if explicit is None or explicit.strip() == "":
        return even_split(num_layers, num_stages)
    if num_stages < 1:
        raise LayerSplitError(
            f"--pipeline-parallel-size must be at least 1, got {num_stages}."
        )
    return parse_layer_split(explicit, num_layers, num_stages)
