"""A single stage whose steps a kernel launcher evaluates on a thread of its own gives mlx-lm's tokens.

Real engine and scheduler, tiny random-weight checkpoints (``tests/architectures.py``) of the packed path
(llama) and the layer-stack path (qwen3_moe), the launcher forced on (on the CPU backend as on CUDA, the
engine thread builds each step while the launcher's thread evaluates the one before): a prompt alone,
prompts batched as they arrive and finish at different steps, a prompt reusing a cached prefix, each equal
to mlx-lm's own greedy generation; seeded sampling with penalties and logprobs the same as without a
launcher. Also which stages may use one (``launcher_wanted``), and that a failed launch reaches the engine
thread.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.engine.launcher import KernelLauncher, launcher_wanted, plain_kv_caches
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.sampling import GREEDY
from tests.architectures import mlx_lm_greedy, tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, read_until_finished, read_with_logprobs

PROMPTS = ((504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12, 13, 14, 15, 16, 17, 18, 19),
           (1, 2, 3), (17, 42, 99, 1000, 5, 6, 7, 8, 9, 10, 11))
MAX_TOKENS = (12, 7, 10)
SHARED_PREFIX = PROMPTS[0][:16] + (7, 7, 7)  # two prefix-cache blocks of 8 shared with PROMPTS[0]


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_a_launched_single_stage_equals_mlx_lm_generation(tmp_path, name):
    from mlx_lm.utils import load

    path = tiny_checkpoint(name, tmp_path)
    model, _ = load(path)
    reference = mlx_lm_greedy(model, PROMPTS + (SHARED_PREFIX,), max(MAX_TOKENS))
    expected = [ref[:n] for ref, n in zip(reference, MAX_TOKENS)]
    spec = read_model_spec(path)
    stage = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32)
    assert plain_kv_caches(stage.new_caches())
    with InProcessPipeline([stage], prefix_cache=PrefixCache(8, b"test"), launcher=True) as pipeline:
        assert pipeline.engine._pipeline.launches_apart
        assert pipeline.generate(PROMPTS[2], MAX_TOKENS[2]) == expected[2]
        first = [pipeline.submit(PROMPTS[0], MAX_TOKENS[0]), pipeline.submit(PROMPTS[1], MAX_TOKENS[1])]
        early = first[0].events.get(timeout=120)
        late = pipeline.submit(PROMPTS[2], MAX_TOKENS[2])  # joins the running decode group, which later shrinks
        outputs, _ = read_until_finished(first + [late])
        outputs[0] = list(early.token_ids) + outputs[0]
        assert outputs == expected
        assert pipeline.generate(SHARED_PREFIX, MAX_TOKENS[0]) == reference[3][:MAX_TOKENS[0]]
        assert pipeline.scheduler.prefix_cache is not None and pipeline.scheduler.prefix_cache.stats.hits >= 16


def test_the_engine_thread_evaluates_nothing_while_prompts_run_together(tmp_path, monkeypatch):
    """Prompt chunks batched on the layer-stack path (merged caches, then each sequence's rows extracted back)
    are built without the engine thread evaluating anything: an evaluation there would encode on the stream the
    launcher's thread is encoding on (on CUDA a corrupted heap). mlx-lm's ``BatchKVCache.extract`` evaluates the
    left padding, so the stage extracts without it (``kv_store.extract_row``); the tokens stay mlx-lm's."""
    import threading

    from mlx_lm.utils import load

    from stage_worker.model import layer_stack

    prompts = (PROMPTS[0][:11], PROMPTS[2], PROMPTS[0][5:16])  # one length: their first chunks run together
    path = tiny_checkpoint("qwen3_moe", tmp_path)
    model, _ = load(path)
    expected = mlx_lm_greedy(model, prompts, 6)
    spec = read_model_spec(path)
    stage = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32)
    grouped: list[int] = []
    evaluated_on: list[str] = []

    def recording_batch_groups(chunks, *args):
        groups = real_batch_groups(chunks, *args)
        grouped.extend(len(group) for group in groups)
        return groups

    def recording_eval(*arrays):
        evaluated_on.append(threading.current_thread().name)
        return real_eval(*arrays)

    real_batch_groups, real_eval = layer_stack.batch_groups, mx.eval
    with InProcessPipeline([stage], launcher=True) as pipeline:
        monkeypatch.setattr(layer_stack, "batch_groups", recording_batch_groups)
        monkeypatch.setattr(mx, "eval", recording_eval)
        outputs, _ = read_until_finished([pipeline.submit(prompt, 6) for prompt in prompts])
        monkeypatch.undo()
    assert max(grouped, default=0) >= 2, "no prompt chunks ran together"
    assert evaluated_on == []
    assert outputs == expected


def test_sampling_with_penalties_and_logprobs_is_the_same_launched(tmp_path):
    """Seeded sampling, penalties (their counts carried on the device from step to step) and logprobs (read back
    while the next step launches) give the same tokens and logprobs with a launcher as without one."""
    path = tiny_checkpoint("qwen3_moe", tmp_path)
    spec = read_model_spec(path)
    sampled = replace(GREEDY, temperature=0.8, top_k=50, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
                      repetition_penalty=1.2, logprobs=3)
    runs = []
    for launcher in (False, True):
        stage = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32)
        with InProcessPipeline([stage], launcher=launcher) as pipeline:
            runs.append(read_with_logprobs([pipeline.submit(PROMPTS[0], 12, sampling=sampled),
                                 pipeline.submit(PROMPTS[1], 9, sampling=replace(sampled, seed=8)),
                                 pipeline.submit(PROMPTS[2], 10)]))
    assert runs[1] == runs[0]
    assert all(len(logprobs) == len(tokens) for tokens, logprobs in runs[1][:2])


def test_which_stages_use_a_launcher():
    plain = {"single_stage": True, "plain_kv_caches": True, "speculating": False, "recording": False}
    assert launcher_wanted("auto", "cuda", **plain)
    assert not launcher_wanted("auto", "cpu", **plain) and not launcher_wanted("auto", "metal", **plain)
    assert launcher_wanted("on", "cpu", **plain) and launcher_wanted("on", "metal", **plain)
    assert not launcher_wanted("off", "cuda", **plain)
    for reason in ("single_stage", "plain_kv_caches"):
        assert not launcher_wanted("on", "cuda", **{**plain, reason: False})
    for reason in ("speculating", "recording"):
        assert not launcher_wanted("on", "cuda", **{**plain, reason: True})


def test_launches_run_in_order_and_a_failed_one_is_raised_where_it_is_waited_for():
    launcher = KernelLauncher()
    try:
        with mx.stream(launcher.stream):
            first = mx.arange(4) * 2
            second = first + 1  # takes the first launch's output
        launched = [launcher.launch([first]), launcher.launch([second])]
        launched[1].wait()
        assert launched[0]._done.is_set()
        assert mx.array(second).tolist() == [1, 3, 5, 7]
        # Built on this thread's own stream, which MLX lets no other thread evaluate.
        failed = launcher.launch([mx.arange(3) + 1])
        with pytest.raises(RuntimeError, match="launching a step's kernels failed"):
            failed.wait()
        launcher.idle()  # the thread goes on after a failure
    finally:
        launcher.close()
