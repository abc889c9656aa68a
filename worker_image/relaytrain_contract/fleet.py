"""The pipelines added to a running job (names.FLEET_FILE): what its stages read to link to
pipelines their own documents do not list (docs/stage-contract.md, `fleet.json` under
"Several pipelines").

A stage document lists the pipelines of the plan the stage was started under. When a
pipeline is added to a running job (by the operator on GPUs free for it, or by `relaytrain
run --local`), the new pipeline's stages get documents that list every pipeline, and the
stages already training learn of it from this document in the job's store: every stage of
every added pipeline, its layers, the address of its replica listener and its identity. A
stage reads it while it trains, links to the added stages that share its layers (a lower
pipeline dials: an added pipeline is above every pipeline it joins), and the pipeline
trains from the step boundary that admits it, as a pipeline coming back does.

`shares`: every pipeline's share of each step's micro-batches as the plan that added them
gives it (they add up to training.microBatches). A pipeline's first stage puts its own into
the membership it agrees on each step, in place of its document's, so the step is shared as
planned, the pipelines started before included (without it each keeps its document's share
as its weight). Which step takes the new shares first does not matter: a step's result does
not depend on how its micro-batches are shared.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from relaytrain_contract.errors import field_error, parse_json
from relaytrain_contract.stage import Count, ReplicaPeer, _Part


class AddedPipeline(_Part):
    """One pipeline added to the job."""

    stages: tuple[ReplicaPeer, ...]
    """Every stage of the pipeline, in order: its layers, its replica listener's address
    (set) and its identity."""

    @model_validator(mode="after")
    def _chain(self) -> AddedPipeline:
        if not self.stages:
            raise field_error("stages", "must list the pipeline's stages, got none")
        pipeline = self.stages[0].pipeline
        end = 0
        for k, stage in enumerate(self.stages):
            if stage.pipeline != pipeline or stage.stage != k:
                raise field_error(
                    "stages", f"must be stages 0, 1, ... of one pipeline in order, got "
                    f"p{stage.pipeline}/s{stage.stage} at position {k}"
                )  # fmt: skip
            if stage.layer_start != end:
                raise field_error(
                    "stages", f"p{pipeline}/s{k} starts at layer {stage.layer_start}, not where "
                    f"the stage before it ends ({end})"
                )  # fmt: skip
            if stage.address is None:
                raise field_error("stages", f"p{pipeline}/s{k} has no address")
            end = stage.layer_end
        return self

    @property
    def pipeline(self) -> int:
        return self.stages[0].pipeline


class FleetDocument(_Part):
    """names.FLEET_FILE: the pipelines added to the job since it started, in pipeline order."""

    added: tuple[AddedPipeline, ...] = ()
    shares: tuple[Count, ...] = ()
    """Every pipeline's planned share of a step's micro-batches, in pipeline order (module
    doc); empty: each pipeline keeps its document's."""

    @model_validator(mode="after")
    def _order(self) -> FleetDocument:
        indexes = [p.pipeline for p in self.added]
        if indexes != sorted(set(indexes)):
            raise field_error("added", f"must list each pipeline once, in order, got {indexes}")
        if self.shares and indexes and len(self.shares) <= indexes[-1]:
            raise field_error(
                "shares", f"must give every pipeline a share, up to pipeline {indexes[-1]}: got "
                f"{len(self.shares)} ({list(self.shares)})"
            )  # fmt: skip
        return self

    @classmethod
    def from_json(cls, document: str | bytes | dict[str, Any]) -> FleetDocument:
        """Parse and validate the document; ConfigError naming the field of every problem."""
        return parse_json(cls, document, "fleet document")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
