from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    text_diff: str = ""                  # text added since the previous streamed output
    token_ids_diff: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    preprocess_time: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
