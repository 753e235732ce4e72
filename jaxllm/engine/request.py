"""A request's host-side state: its tokens, pages, decode window and timing."""

import dataclasses
import enum
import time

import numpy as np

from jaxllm.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestStats:
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    prefill_done_time: float | None = None
    first_block_time: float | None = None
    finished_time: float | None = None
    num_forwards: int = 0  # denoising forwards this request took part in (prefill excluded)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    def as_dict(self, num_generated: int) -> dict:
        ms = lambda a, b: None if a is None or b is None else round(1e3 * (b - a), 3)  # noqa: E731
        return dict(
            queue_time_ms=ms(self.arrival_time, self.first_scheduled_time),
            prefill_time_ms=ms(self.first_scheduled_time, self.prefill_done_time),
            time_to_first_block_ms=ms(self.arrival_time, self.first_block_time),
            total_time_ms=ms(self.arrival_time, self.finished_time),
            forward_passes=self.num_forwards,
            tokens_per_forward=round(num_generated / self.num_forwards, 4) if self.num_forwards else None,
            cached_tokens=self.num_cached_tokens,
            preemptions=self.num_preemptions,
        )


@dataclasses.dataclass
class Window:
    """The blocks in flight (host copy of decoding.WindowState for one request)."""

    tokens: np.ndarray  # i32[Q]
    fixed: np.ndarray  # bool[Q] prompt positions
    num_active_blocks: int
    block_steps: np.ndarray  # i32[N]
    block_masks: np.ndarray  # i32[N]
    post_steps: np.ndarray  # i32[N]

    @classmethod
    def start(cls, prompt_tail: list[int], num_blocks: int, block_size: int, mask_token_id: int) -> "Window":
        tokens = np.full(num_blocks * block_size, mask_token_id, np.int32)
        tokens[: len(prompt_tail)] = prompt_tail
        fixed = np.zeros(num_blocks * block_size, bool)
        fixed[: len(prompt_tail)] = True
        zeros = np.zeros(num_blocks, np.int32)
        return cls(tokens, fixed, 1, zeros, zeros.copy(), zeros.copy())

    def shift(self, num_blocks: int, block_size: int, mask_token_id: int) -> None:
        """Drop the first num_blocks (committed) and append fresh placeholder blocks."""
        cut = num_blocks * block_size
        self.tokens = np.concatenate([self.tokens[cut:], np.full(cut, mask_token_id, np.int32)])
        self.fixed = np.concatenate([self.fixed[cut:], np.zeros(cut, bool)])
        self.num_active_blocks = max(self.num_active_blocks - num_blocks, 1)
        for name in ("block_steps", "block_masks", "post_steps"):
            values = getattr(self, name)
            setattr(self, name, np.concatenate([values[num_blocks:], np.zeros(num_blocks, np.int32)]))


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.page_ids: list[int] = []
        self.page_hashes: list[bytes] = []  # of the full pages up to the prefill target, made at admission (caching)
        self.context_len = 0  # tokens whose KV is in the pool (prefilled or committed); block-aligned
        self.commit_sizes: list[int] = []  # tokens of each commit in order: blocks committed together, in one forward
        self.window: Window | None = None
        self.finish_reason: str | None = None
        self.text = ""  # detokenized output, stop strings trimmed
        self.stopped_by_token = False  # the last output id is a stop token: an id of the output, not text of it
        self.stats = RequestStats()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def prefill_target(self, block_size: int) -> int:
        """Tokens prefilled before decoding: the whole blocks of prompt plus committed output."""
        return len(self.all_token_ids) // block_size * block_size


@dataclasses.dataclass
class RequestOutput:
    """What a step produced for one request: newly committed tokens and text, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # all output so far
    text: str = ""
    stats: dict = dataclasses.field(default_factory=dict)
