from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class StageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_STATE_UNSPECIFIED: _ClassVar[StageState]
    STAGE_STATE_LOADING: _ClassVar[StageState]
    STAGE_STATE_CONNECTING: _ClassVar[StageState]
    STAGE_STATE_SERVING: _ClassVar[StageState]
    STAGE_STATE_DRAINING: _ClassVar[StageState]
    STAGE_STATE_FAILED: _ClassVar[StageState]
    STAGE_STATE_STOPPED: _ClassVar[StageState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
STAGE_STATE_UNSPECIFIED: StageState
STAGE_STATE_LOADING: StageState
STAGE_STATE_CONNECTING: StageState
STAGE_STATE_SERVING: StageState
STAGE_STATE_DRAINING: StageState
STAGE_STATE_FAILED: StageState
STAGE_STATE_STOPPED: StageState

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "logprobs", "allowed_token_ids", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_tokens", "sampling", "stop_token_ids", "ignore_eos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: GenerateRequest
    cancel: str
    def __init__(self, start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[GenerateUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[GenerateUpdate, _Mapping]]] = ...) -> None: ...

class GenerateUpdate(_message.Message):
    __slots__ = ("request_id", "response", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("running", "waiting")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class GetStageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("batches", "tokens", "compute_seconds", "wait_seconds", "send_seconds", "running_sequences", "waiting_requests", "requests_finished", "kv_tokens", "kv_token_capacity", "generated_tokens", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_blocks", "prefix_cache_evictions", "load_done_bytes", "load_total_bytes", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LOAD_DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    tokens: int
    compute_seconds: float
    wait_seconds: float
    send_seconds: float
    running_sequences: int
    waiting_requests: int
    requests_finished: int
    kv_tokens: int
    kv_token_capacity: int
    generated_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_blocks: int
    prefix_cache_evictions: int
    load_done_bytes: int
    load_total_bytes: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batches: _Optional[int] = ..., tokens: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., send_seconds: _Optional[float] = ..., running_sequences: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., requests_finished: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., kv_token_capacity: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., load_done_bytes: _Optional[int] = ..., load_total_bytes: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("replica", "rank", "world_size", "layer_start", "layer_end", "num_layers", "host", "grpc_port", "ring_port", "lane_port", "pid", "node_id", "model", "compute_dtype", "quantized", "state", "error", "weight_bytes", "peak_rss_bytes", "max_num_seqs", "max_model_len", "version", "stats", "blas", "backend", "device")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    BLAS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    replica: int
    rank: int
    world_size: int
    layer_start: int
    layer_end: int
    num_layers: int
    host: str
    grpc_port: int
    ring_port: int
    lane_port: int
    pid: int
    node_id: str
    model: str
    compute_dtype: str
    quantized: bool
    state: StageState
    error: str
    weight_bytes: int
    peak_rss_bytes: int
    max_num_seqs: int
    max_model_len: int
    version: str
    stats: StageStats
    blas: str
    backend: str
    device: str
    def __init__(self, replica: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., host: _Optional[str] = ..., grpc_port: _Optional[int] = ..., ring_port: _Optional[int] = ..., lane_port: _Optional[int] = ..., pid: _Optional[int] = ..., node_id: _Optional[str] = ..., model: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., quantized: _Optional[bool] = ..., state: _Optional[_Union[StageState, str]] = ..., error: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., version: _Optional[str] = ..., stats: _Optional[_Union[StageStats, _Mapping]] = ..., blas: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...
