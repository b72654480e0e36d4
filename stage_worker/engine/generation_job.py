"""A fixed batch of prompts generated to completion through an ``EntryPipeline``.

Used by the parity tool and the end-to-end tests before any server exists: every
prompt enters as a new sequence in one batch (prefill), then each step feeds
every unfinished sequence its last token, until ``max_tokens`` or an EOS id.
Results are token ids only; tokenization is the caller's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from stage_worker.batch import Chunk, RecordFlag, SequenceRecord
from stage_worker.engine.stage_runtime import EntryPipeline
from stagemesh_core.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class GenerationJob:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    eos_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"prompts": [list(p) for p in self.prompts], "max_tokens": self.max_tokens,
                "sampling": self.sampling.to_json(), "eos_ids": list(self.eos_ids)}

    @classmethod
    def from_dict(cls, raw: dict) -> GenerationJob:
        return cls(
            prompts=tuple(tuple(p) for p in raw["prompts"]),
            max_tokens=raw["max_tokens"],
            sampling=SamplingParams.from_json(raw["sampling"]) if "sampling" in raw else GREEDY,
            eos_ids=tuple(raw.get("eos_ids", ())),
        )


@dataclass(frozen=True)
class GenerationResult:
    outputs: list[list[int]]
    prefill_s: float  # until every prompt had its first token
    total_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding, summed over sequences."""
        decoded = sum(max(0, len(o) - 1) for o in self.outputs)
        seconds = self.total_s - self.prefill_s
        return decoded / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"outputs": self.outputs, "prefill_s": self.prefill_s, "total_s": self.total_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


def run_generation(pipeline: EntryPipeline, job: GenerationJob) -> GenerationResult:
    if job.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if any(len(p) == 0 for p in job.prompts):
        raise ValueError("every prompt needs at least one token")
    outputs: list[list[int]] = [[] for _ in job.prompts]
    positions = [len(p) for p in job.prompts]
    chunks = [
        Chunk(
            SequenceRecord(seq_id, 0, len(prompt), RecordFlag.NEW_SEQUENCE | RecordFlag.SAMPLE,
                           job.sampling),
            tuple(prompt),
        )
        for seq_id, prompt in enumerate(job.prompts)
    ]
    started = time.perf_counter()
    prefill_s = 0.0
    while chunks:
        sampled = pipeline.step(chunks)
        if not prefill_s:
            prefill_s = time.perf_counter() - started
        next_chunks = []
        for token in sampled:
            out = outputs[token.seq_id]
            out.append(token.token_id)
            if len(out) >= job.max_tokens or token.token_id in job.eos_ids:
                # A zero-token RELEASE record rides the next batch and frees the KV everywhere.
                release = SequenceRecord(token.seq_id, positions[token.seq_id], 0, RecordFlag.RELEASE)
                next_chunks.append(Chunk(release, ()))
                continue
            record = SequenceRecord(token.seq_id, positions[token.seq_id], 1, RecordFlag.SAMPLE,
                                    job.sampling)
            positions[token.seq_id] += 1
            next_chunks.append(Chunk(record, (token.token_id,)))
        if all(c.record.num_tokens == 0 for c in next_chunks) and next_chunks:
            pipeline.step(next_chunks)
            break
        chunks = next_chunks
    return GenerationResult(outputs, prefill_s, time.perf_counter() - started)

