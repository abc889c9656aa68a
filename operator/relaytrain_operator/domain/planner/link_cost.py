"""The links' cost model: the bytes a pipeline boundary carries per micro-batch, and the time
of sending them (the stages' compute and memory: cost.py).

A boundary carries activations forward (plus labels and mask, int64 per token) and
their gradients backward, each compressed. A frame takes bytes / min(bandwidth of both ends)
on its link's direction, and arrives the sum of both ends' latencies later. The worker sends
beside its compute (a link's sender thread; the ``delta`` codec on a GPU stage's side stream),
so a stage's beat is the busiest of its compute, its two sends' directions and its encoder
(`LinkCost.side_seconds`), and the step is 1F1B played out over the links with their
latencies (`steptime`). ``LinkCost.stage_seconds`` is a stage's link time in turn: what it
would pay if nothing overlapped (``predictedLinkSeconds`` in ``relaytrain plan --json``).
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain_operator.domain.planner.cost import PoolCost
from relaytrain_operator.domain.planner.model_shape import ModelShape
from relaytrain_operator.domain.planner.training import TrainingShape

#: Bytes per value on the wire (relaytrain_worker.pipeline.compression: blocks of 64 with a
#: bf16 scale).
WIRE_BYTES = {"bf16": 2.0, "int8": 1.0 + 2 / 64, "int4": 0.5 + 2 / 64}
#: ``delta`` (relaytrain_worker.pipeline.boundary): each block of 64 activation values of a
#: training row gets its own bits, 0-4, the fewest whose expected error stays within int4's
#: (a bf16 scale per block sent, 3 bits a block for its bits). A row's first crossing costs
#: about int4's rate, exactly 4 bits a value where its blocks are alike; later epochs code
#: only what changed, so their rate falls with the drift (docs/links-and-checkpoints.md).
#: Gradients at ``spec.pipeline.gradientBits`` (2 by default), a bf16 scale per 64 values
#: (`delta_gradient_bytes`). A job of steps is priced at the first epoch's rate, the
#: slowest; with ``pipeline.activationError: int3``, at int3's, and a row's sink at
#: ``SINK_BITS`` (`delta_first_bytes`). A job of ``spec.training.epochs`` E is priced at its
#: run's mean (`delta_forward_bytes`): the first epoch at that rate and each later one at
#: ``DELTA_LATER_SHARE`` of it.
DELTA_FIRST_BYTES = (4 + 16 / 64 + 3 / 64) / 8
#: Bits a value of a row's first token on its first crossing: a pretrained model's attention
#: sink, whose massive activations (more than `relaytrain_worker.pipeline.allocation.MASSIVE`
#: times the row's median token's energy) cross at the code's most bits, 8
#: (`deltacache.DeltaConfig.allocate`). Every pretrained language model measured has one from
#: its middle layers on (SmolLM2-135M: 93-99.8 % of a row's energy after its layer 15); the
#: plan cannot know whether a job's model has it, so it always prices it, a bound: ``8 - b``
#: bits more a row's value of it, for a ``b``-bit code. Measured first crossings of SmolLM2's
#: boundaries in the identity (`bench/bench_boundary_spectrum.py --codes --seq 32 --rows 64`
#: and ``--seq 512 --rows 24``, the 2-core dev VM, 2026-12-07): 4.27-4.44 bits a value at
#: int4's error in rows of 32 tokens, priced 4.42; 4.20-4.26 in rows of 512, priced 4.30; at
#: int3's 3.19-3.39 in rows of 32, priced 3.45. The rest of a row's blocks take fewer bits for
#: it (0-8 a block, each within the row's budget): so 512 tokens cost less than 4.30.
SINK_BITS = 8
#: What a later epoch's activations cost under ``delta`` as a share of the first's price
#: (`delta_first_bytes`). The rows' drift decides it, which no plan knows before the run, and
#: since 2026-12-07 a row's change at int4's error is held to a quarter of its first code's
#: (relaytrain_worker.pipeline.boundary.ACTIVATION_ERRORS): its second crossing pays to halve the
#: first's error even where the row did not move (a row that moved far, since later that day, at
#: up to the first's error again: cheaper). This is the dearest mean measured, rounded
#: up (`bench/bench_delta_boundary.py`, 4 stages, the activations' bits a value of the later
#: epochs against the first's price, 2026-12-07): 0.82 where a tiny Llama's LoRA learns a
#: language from a random base (6 epochs, rows moving 95-5 % an epoch; 0.91 of what its first
#: epoch cost), 0.57 on a fine-tune of a pretrained one (50-1.6 %; 0.80 of its first epoch),
#: 0.49 on SmolLM2-135M's (3 epochs of rows of 32 tokens). Held to the first code's error
#: they were 0.72 and 0.46 of the first epoch (2026-11-29). A later crossing in the identity
#: costs at most the first's price (a change's blocks take 0-4 bits), so a plan that took
#: delta on this price is at worst delta's first-epoch speed: about int4's (docs/planner.md).
DELTA_LATER_SHARE = 0.85
#: Seconds per boundary value of the ``delta`` codec on a GPU stage, encode plus decode: it
#: codes on the sending stage's card and decodes on the receiving one's (the rows' caches
#: stay on the host; so did the per-row choice of bits when this was measured, most of the
#: forward's time: on the card since 2026-12-05, and re-measured by the next card run's
#: codec probe, `hack/gpu-check.sh time-to-loss`). Forward a row's first code (a later one
#: costs about as much), backward the gradients' 3-bit code.
#: `bench/bench_codec_speed.py --device cuda --quick --tokens 4096 --hidden 4096` on an
#: NVIDIA H200, 2026-11-30 (33.5 M values a frame: 15.6 + 1.7 ns forward, 0.2 + 0.1 back;
#: on one CPU thread, where a CPU stage codes, 217 + 15 and 174 + 14). The other codes run
#: on the stage's device (next to nothing) and are charged nothing.
DELTA_FORWARD_CODEC_SECONDS = 17.3e-9
DELTA_BACKWARD_CODEC_SECONDS = 0.3e-9
#: Seconds per byte of a ``delta`` frame's codes to deflate them on the sending host and to
#: inflate them on the receiving one (frames.py, one CPU thread: `bench/bench_codec_speed.py`,
#: the 2-core dev VM, 2026-11-30). A stage pays what the deflate takes beyond the send it
#: overlaps (a link's encoder thread deflates a frame while its sender sends the one before),
#: the inflate as the codec's time. Of what deflate saves the plan counts its floor,
#: ``DEFLATE_FORWARD_SAVES`` of the activations: a real model's frames lose least, 1.3-2.7 %
#: a boundary (SmolLM2-135M's fine-tune, 1.8 % over its run, `bench/bench_delta_boundary.py
#: --model smollm2`, 2026-12-07), where Gaussian codes' lose 5.6 % (maps, scales, integers)
#: and a tiny model's fine-tune 11-16 %. Gradient frames do not shrink: sent as coded.
DEFLATE_SECONDS_PER_BYTE = 38.9e-9
INFLATE_SECONDS_PER_BYTE = 5.6e-9
DEFLATE_FORWARD_SAVES = 0.013
#: ``pipeline.activationBasis: fitted`` (relaytrain_worker.pipeline.transform): the sender fits
#: an ``h x h`` basis for a kind of rows (full codes, deltas) after every ``BASIS_REFIT`` frames
#: of it and sends it ahead of the rows coded in it. The rows in it are priced as the
#: identity's (what a basis saves depends on the rows: 14-18 % of the activations' on the tiny
#: fine-tune measured); each activation frame is charged a ``1 / BASIS_REFIT`` share of a
#: basis: `basis_bytes` on the wire and `basis_fit_seconds` of both ends' work on the frames'
#: way. A run's first fit of each kind, after `transform.FIRST_FIT` frames of it, is left out:
#: a run of N frames a boundary fits about N / 96 + 2 times.
BASIS_REFIT = 96
#: A basis's work on the frames' way, both ends, on one CPU thread: the sender's float64
#: ``eigh`` of the moment, ``BASIS_FIT_SECONDS_PER_H3`` h^3 (timed alone: 0.36, 2.6 and 24.8 s
#: at 1024, 2048 and 4096), and its code made and read, ``BASIS_CODE_SECONDS_PER_H2`` h^2 (the
#: rest); under a width of ``BASIS_QR_BESIDE_WIDTH`` each end's float64 QR of it too,
#: ``BASIS_QR_SECONDS_PER_H3`` h^3 an end, which from that width runs beside the frames
#: (`transform.switch_frames`, since 2026-12-06) and is not charged. Measured by
#: `bench/bench_codec_speed.py --quick --tokens 256 --hidden H --basis` (its line "The fit of a
#: ... basis"; the 2-core dev VM, 2026-12-06, quiet): 1.8-2.4, 5.0-5.1 and 30.8-33.5 s at 1024,
#: 2048 and 4096, priced 1.3, 5.4 and 33.4. The VM ran 1.7-1.9x faster beside that day's CI
#: run (18.8 s at 4096). A GPU stage runs its ``eigh`` in float32 on its card, not yet
#: measured there (the first card run's fits, 45-56 s a step of three boundaries with both
#: QRs on one thread, leave a card's eigh and code a few seconds at most): priced as a CPU
#: stage's, a bound.
BASIS_FIT_SECONDS_PER_H3 = 3.4e-10
BASIS_CODE_SECONDS_PER_H2 = 6.0e-7
BASIS_QR_SECONDS_PER_H3 = 1.5e-10
BASIS_QR_BESIDE_WIDTH = 2048
#: Labels and attention mask travel forward with the activations, int64 each.
LABEL_BYTES_PER_TOKEN = 16


def wire_bytes_per_value(training: TrainingShape, backward: bool = False) -> float:
    """Bytes a boundary value costs on the wire as the plan prices it, forward (activations)
    or ``backward`` (their gradients)."""
    if training.compression == "none":
        return float(training.dtype_bytes)
    if training.compression == "delta":
        if not backward:
            return delta_forward_bytes(
                training.activation_bits, training.epochs, training.sequence_length
            )
        coded = delta_gradient_bytes(training.gradient_bits)
        share = training.gradient_tokens
        if training.gradient_fill:  # as many as the activations' bytes leave room for
            share = min(1.0, max(share, wire_bytes_per_value(training) / coded))
        if share >= 1.0:
            return coded
        # a share of the tokens coded, and a bit a token (at most 1/64 of a bit a value)
        return coded * share + 1 / 64 / 8
    return WIRE_BYTES[training.compression]


def basis_bytes(width: int) -> float:
    """The most a basis of ``width`` values a token costs on the wire: every vector at 8 bits,
    two bf16 scales a block of 64 of its values, and 4 bits a vector naming its bits (where
    ``width`` is a multiple of 64, as models' are; `transform.BasisMessage.nbytes`)."""
    return (1 + 4 / 64) * width * width + width / 2


def basis_fit_seconds(width: int) -> float:
    """Seconds both ends of a link spend on one basis of ``width`` values a token on the
    frames' way: fitting, coding and reading it, and under ``BASIS_QR_BESIDE_WIDTH`` the QRs
    that install it (one CPU thread; ``BASIS_FIT_SECONDS_PER_H3``)."""
    qr = 2 * BASIS_QR_SECONDS_PER_H3 * width**3 if width < BASIS_QR_BESIDE_WIDTH else 0.0
    return BASIS_FIT_SECONDS_PER_H3 * width**3 + BASIS_CODE_SECONDS_PER_H2 * width**2 + qr


def basis_share(width: int) -> tuple[float, float]:
    """What each activation frame pays for fitted bases of ``width`` values a token: a
    ``BASIS_REFIT``-th of a basis's bytes (`basis_bytes`) and of its seconds on the frames'
    way (`basis_fit_seconds`)."""
    return basis_bytes(width) / BASIS_REFIT, basis_fit_seconds(width) / BASIS_REFIT


def delta_first_bytes(bits: int, tokens: int) -> float:
    """Wire bytes a value of a row of ``tokens`` tokens on its first crossing under ``delta``
    held to a ``bits``-bit code's error: that code's bits, its scales and the bit map, and its
    sink's token at ``SINK_BITS``."""
    return DELTA_FIRST_BYTES - (4 - bits) / 8 + (SINK_BITS - bits) / 8 / tokens


def delta_gradient_bytes(bits: int) -> float:
    """Wire bytes a gradient value sent under ``delta`` costs: ``bits`` and a bf16 scale a
    block of 64."""
    return (bits + 16 / 64) / 8


def delta_forward_bytes(bits: int, epochs: int | None, tokens: int) -> float:
    """Wire bytes a value of a row of ``tokens`` tokens costs under ``delta``, the mean over a
    run of ``epochs`` passes (None: a job of steps, whose passes the plan does not know: the
    first epoch's rate): the first pass at `delta_first_bytes`, each later one at
    ``DELTA_LATER_SHARE`` of it."""
    first = delta_first_bytes(bits, tokens)
    if epochs is None or epochs <= 1:
        return first
    return first * (1 + (epochs - 1) * DELTA_LATER_SHARE) / epochs


@dataclass(frozen=True)
class LinkCost:
    """Bytes a boundary carries per micro-batch."""

    forward_bytes: float
    """Activations (compressed) plus labels and mask, sent from stage k to k+1."""
    backward_bytes: float
    """Gradients of those activations (compressed), sent from k+1 back to k."""
    forward_codec_seconds: float = 0.0
    """Time to encode and decode the activations (``delta`` only; in fitted bases with a
    share of a basis's fit)."""
    backward_codec_seconds: float = 0.0
    """CPU time to encode and decode their gradients (``delta`` only)."""
    deflate_seconds: float = 0.0
    """CPU time to deflate the activations' codes beside the send before (``delta`` only;
    its gradients' frames go as coded: they do not shrink, `boundary.DEFLATE_PAYS`)."""

    @classmethod
    def of(cls, model: ModelShape, training: TrainingShape) -> LinkCost:
        h = model.hidden_size
        values = training.tokens_per_micro_batch * h
        forward = values * wire_bytes_per_value(training)
        backward = values * wire_bytes_per_value(training, backward=True)
        labels = training.tokens_per_micro_batch * LABEL_BYTES_PER_TOKEN
        if training.compression != "delta":
            return cls(forward + labels, backward)
        fit = 0.0
        if training.activation_basis == "fitted":
            share, fit = basis_share(h)
            forward += share
        return cls(
            forward * (1 - DEFLATE_FORWARD_SAVES) + labels, backward,
            values * DELTA_FORWARD_CODEC_SECONDS + fit + forward * INFLATE_SECONDS_PER_BYTE,
            values * DELTA_BACKWARD_CODEC_SECONDS,
            forward * DEFLATE_SECONDS_PER_BYTE,
        )  # fmt: skip

    def send_seconds(self, nbytes: float, a: PoolCost, b: PoolCost) -> float:
        """Time to send ``nbytes`` between a GPU of pool ``a`` and one of pool ``b``: its
        frame's time on the link and both ends' latencies."""
        return frame_seconds(nbytes, a, b) + a.latency_s + b.latency_s

    def side_seconds(self, prev: PoolCost | None, this: PoolCost, nxt: PoolCost | None) -> float:
        """The busiest of what runs beside a stage's compute, per micro-batch, as `steptime`
        plays it: its activations' frame down the link to ``nxt``, its gradients' frame up
        the link to ``prev`` (each direction its own queue) and its encoder (the ``delta``
        codes of both, and the activations' deflate)."""
        down = frame_seconds(self.forward_bytes, this, nxt) if nxt is not None else 0.0
        up = frame_seconds(self.backward_bytes, prev, this) if prev is not None else 0.0
        return max(down, up, self.encode_seconds(prev, nxt))

    def encode_seconds(self, prev: PoolCost | None, nxt: PoolCost | None) -> float:
        """A stage's encoder per micro-batch (`side_seconds`): the codes of the activations it
        sends to ``nxt`` and their deflate, and the codes of the gradients it sends to
        ``prev`` (``delta`` only: 0 for the other codes)."""
        encode = 0.0
        if nxt is not None:
            encode += self.forward_codec_seconds + self.deflate_seconds
        if prev is not None:
            encode += self.backward_codec_seconds
        return encode

    def stage_seconds(self, prev: PoolCost | None, this: PoolCost, nxt: PoolCost | None) -> float:
        """Link time a stage pays per micro-batch: its sends to both neighbours, each with
        the CPU time of coding it."""
        total = 0.0
        for nbytes, codec, deflate, peer in (
            (self.forward_bytes, self.forward_codec_seconds, self.deflate_seconds, nxt),
            (self.backward_bytes, self.backward_codec_seconds, 0.0, prev),
        ):
            if peer is not None:
                send = self.send_seconds(nbytes, this, peer)
                total += send + codec + max(0.0, deflate - send)
        return total


def frame_seconds(nbytes: float, a: PoolCost, b: PoolCost) -> float:
    """Seconds ``nbytes`` take on the link between a GPU of pool ``a`` and one of pool ``b``
    (the slower end's bandwidth), latency aside."""
    return nbytes / min(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s)
