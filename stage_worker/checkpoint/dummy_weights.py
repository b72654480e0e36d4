"""Random weights for one stage's slice (``--load-format dummy``), so real model sizes run without their files.

Contract: ``dummy_stage_weights(spec, layers, with_embedding, with_head, dtype)`` returns what
``stage_weights.load_stage_weights`` would return for a checkpoint of ``spec``'s shapes (mlx-lm names with
GLOBAL layer indices, only the slice's tensors, evaluated, quantized where ``spec`` says), except that the
values are random. The names and shapes are those of mlx-lm's own model for the architecture
(``parameter_shapes``), so ``StageModel.load`` loads them strictly. Each tensor is a pure function of its
global name, shape and dtype (``tensor_key``), so every pipeline layout computes with the same model (PP=N's
greedy tokens equal PP=1's). Values follow a real initialisation (``random_tensor``), so activations stay
finite in float16 and bfloat16.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec
from stage_worker.checkpoint.safetensors_format import wanted

DEFAULT_INIT_STD = 0.02  # Hugging Face's initializer_range default for llama, qwen2 and qwen3


def tensor_key(name: str) -> mx.array:
    """The random key of one tensor: a hash of its global name, so no stage layout changes it (a tensor is the
    same whichever stage makes it, and the tied embedding on the last stage equals the first stage's)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return mx.random.key(seed)


def init_std(spec: ModelSpec) -> float:
    """The matrices' std: the config's ``initializer_range``, else ``DEFAULT_INIT_STD``."""
    return float(spec.args.get("initializer_range") or DEFAULT_INIT_STD)


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of mlx-lm's model for ``spec``, by global name (the model is built lazily: nothing of it
    is allocated, shapes only)."""
    return _model_layout(spec)[0]


def _model_layout(spec: ModelSpec) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Parameter shapes by global name, and the modules mlx-lm can quantize (those with ``to_quantized``:
    linears, embeddings, expert stacks; not, say, DeepSeek's router gate)."""
    arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(dict(spec.args)))
    # mlx annotates tree_flatten as returning a list or a dict; without ``destination`` it is the list.
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    quantizable = frozenset(name for name, module in model.named_modules() if hasattr(module, "to_quantized"))
    return {name: tuple(array.shape) for name, array in flat}, quantizable


def random_tensor(name: str, shape: tuple[int, ...], dtype: mx.Dtype, std: float) -> mx.array:
    """One dense tensor, lazily: biases 0, norm scales 1, matrices (and expert stacks) normal(0, std)."""
    if name.endswith(".bias"):
        return mx.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        # Every other 1-D parameter of llama/qwen2/qwen3 is an RMSNorm's scale.
        return mx.ones(shape, dtype=dtype)
    return mx.random.normal(shape, dtype=dtype, scale=std, key=tensor_key(name))


def _units(names: list[str]) -> Iterator[list[str]]:
    """The names in groups evaluated together: one decoder layer, or one tensor of the ends."""
    group: list[str] = []
    owner = None
    for name in names:
        this = ".".join(name.split(".", 3)[:3]) if name.startswith("model.layers.") else name
        if group and this != owner:
            yield group
            group = []
        owner = this
        group.append(name)
    if group:
        yield group


def _layer_order(name: str) -> tuple[int, str]:
    if name.startswith("model.layers."):
        return int(name.split(".", 3)[2]), name
    return -1, name


def dummy_stage_weights(
    spec: ModelSpec, layers: range, with_embedding: bool, with_head: bool, dtype: mx.Dtype, evaluate: bool = True
) -> dict[str, mx.array]:
    """Random, evaluated weights for exactly the tensors this stage holds.

    Tensors are generated directly in ``dtype`` (no float32 copy of the model); a module the spec quantizes
    (``spec.quantization_for``) arrives as ``mx.quantize`` of its random dense weight in the module's mode
    (``.weight``, ``.scales`` and, affine only, ``.biases``). Each decoder layer is evaluated before the next is
    made, so memory peaks at the slice plus a few of its largest tensors. Without ``evaluate`` they stay lazy
    for whoever cuts them (a tensor-parallel member), which generates each as its cut is evaluated.
    """
    std = init_std(spec)
    shapes, quantizable = _model_layout(spec)
    kept = sorted((n for n in shapes if wanted(n, layers, with_embedding, with_head, spec.tie_word_embeddings)),
                  key=_layer_order)
    weights: dict[str, mx.array] = {}
    for unit in _units(kept):
        made: dict[str, mx.array] = {}
        for name in unit:
            dense = random_tensor(name, shapes[name], dtype, std)
            module = name.removesuffix(".weight")
            # What mlx-lm quantizes: matrices and expert stacks ([experts, out, in]); norms and biases never.
            quant = spec.quantization_for(module) if name.endswith(".weight") and module in quantizable else None
            if quant is None:
                made[name] = dense
                continue
            try:
                made[name], made[f"{module}.scales"], *biases = mx.quantize(dense, **quant.as_kwargs())
            except ValueError as exc:
                raise ModelFormatError(
                    f"cannot quantize {module} {list(dense.shape)} as {quant.describe()}: {exc}; change the "
                    "config's quantization block."
                ) from exc
            if biases:  # affine only; the fp modes have none
                made[f"{module}.biases"] = biases[0]
        # One layer at a time: its lazy dense weights (quantized or not) are freed before the next is made.
        if evaluate:
            mx.eval(list(made.values()))
        weights.update(made)
    return weights
