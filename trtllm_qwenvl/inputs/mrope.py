"""Multimodal rotary (M-RoPE) position ids for Qwen2.5-VL and Qwen3-VL(-MoE).

A numpy port of `get_rope_index` from transformers 5.17, kept bit-exact with it (quirks included) so the
engine's prefill and decode positions match the reference model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUTS = ("qwen2_5_vl", "qwen3_vl")
_LAYOUT_BY_MODEL_TYPE = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
                         "qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl"}  # Qwen3.5 positions as Qwen3-VL
_TEXT, _IMAGE, _VIDEO = 0, 1, 2


@dataclass(frozen=True)
class MRopeSpec:
    layout: str  # "qwen2_5_vl" or "qwen3_vl"
    spatial_merge_size: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int  # for callers: HF 5.17 delimits vision segments by pad-token runs alone
    tokens_per_second: float = 2.0  # Qwen2.5-VL only

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown M-RoPE layout {self.layout!r}, expected one of {LAYOUTS}")

    @classmethod
    def from_hf_config(cls, config) -> MRopeSpec:
        """Build from a Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE config object or its dict (config.json) form.

        transformers 5.17 keeps the special token ids on the top-level config, not on text_config.
        """
        if isinstance(config, dict):
            config = _config_from_dict(config)
        layout = _LAYOUT_BY_MODEL_TYPE.get(config.model_type)
        if layout is None:
            raise ValueError(f"no M-RoPE layout for model_type {config.model_type!r}")
        vision = config.vision_config
        # Qwen3-VL has no tokens_per_second: its frames are timed by timestamp text instead.
        timing = {"tokens_per_second": vision.tokens_per_second} if layout == "qwen2_5_vl" else {}
        return cls(
            layout=layout,
            spatial_merge_size=vision.spatial_merge_size,
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            vision_start_token_id=config.vision_start_token_id,
            **timing,
        )


def _config_from_dict(config: dict):
    # Imported here so the engine's hot path never pays for importing transformers.
    from transformers import AutoConfig

    return AutoConfig.for_model(**config)


def text_positions(length: int) -> np.ndarray:
    """(3, length) positions of a text-only sequence: the same arange on every axis."""
    return np.tile(np.arange(length, dtype=np.int64), (3, 1))


def get_rope_index(
    spec: MRopeSpec,
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """input_ids (L,) for ONE sequence; grids (n,3) int in prompt order. Returns positions (3, L) int64 and
    the decode delta (int) such that the position of generated token at index j >= L is j + delta on all 3 axes."""
    input_ids = np.asarray(input_ids).reshape(-1)
    runs = _find_vision_runs(spec, input_ids)
    items = {
        _IMAGE: _list_image_items(image_grid_thw),
        _VIDEO: _list_video_items(spec, video_grid_thw, second_per_grid_ts),
    }
    _check_counts(runs, items)
    pending = {kind: iter(kind_items) for kind, kind_items in items.items()}

    blocks, cursor, next_pos = [], 0, 0
    for start, end, kind in runs:
        blocks.append(text_positions(start - cursor) + next_pos)
        next_pos += start - cursor
        grid, interval = next(pending[kind])
        blocks.append(_grid_positions(grid, spec.spatial_merge_size, interval, end - start) + next_pos)
        # HF advances by the spatial extent only, even when scaled video times reach further.
        next_pos += max(grid[1], grid[2]) // spec.spatial_merge_size
        cursor = end
    blocks.append(text_positions(len(input_ids) - cursor) + next_pos)

    positions = np.concatenate(blocks, axis=1)
    delta = int(positions.max(initial=-1)) + 1 - len(input_ids)
    return positions, delta


def _find_vision_runs(spec: MRopeSpec, input_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, kind) of each maximal run of image or video pad tokens, in prompt order.

    HF segments by runs of `mm_token_type_ids`, which the processor derives from these same two token ids.
    """
    kinds = np.select([input_ids == spec.image_token_id, input_ids == spec.video_token_id], [_IMAGE, _VIDEO], _TEXT)
    bounds = np.flatnonzero(np.diff(kinds, prepend=_TEXT, append=_TEXT))
    return [(int(s), int(e), int(kinds[s])) for s, e in zip(bounds[:-1], bounds[1:]) if kinds[s] != _TEXT]


def _list_image_items(image_grid_thw: np.ndarray | None) -> list[tuple[np.ndarray, float]]:
    """(grid, temporal interval) per image: images are never time-scaled."""
    return [(grid, 1) for grid in _as_grids(image_grid_thw)]


def _list_video_items(
    spec: MRopeSpec, video_grid_thw: np.ndarray | None, second_per_grid_ts: np.ndarray | None
) -> list[tuple[np.ndarray, float]]:
    """(grid, temporal interval) per video run: a whole video for Qwen2.5-VL, one frame for Qwen3-VL."""
    grids = _as_grids(video_grid_thw)
    if spec.layout == "qwen3_vl":
        # Timestamp text splits a Qwen3-VL video into one t=1 run per temporal grid.
        frames = np.repeat(grids, grids[:, 0], axis=0)
        frames[:, 0] = 1
        return [(frame, 1) for frame in frames]
    seconds = np.ones(len(grids)) if second_per_grid_ts is None else np.asarray(second_per_grid_ts).reshape(-1)
    # HF 5.17 truncates seconds-per-grid to an int before scaling (0.5 s -> 0); mirrored for parity.
    return [(grid, spec.tokens_per_second * int(sec)) for grid, sec in zip(grids, seconds)]


def _as_grids(grid_thw: np.ndarray | None) -> np.ndarray:
    if grid_thw is None:
        return np.zeros((0, 3), dtype=np.int64)
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def _check_counts(runs: list[tuple[int, int, int]], items: dict[int, list]) -> None:
    for kind, name in ((_IMAGE, "image"), (_VIDEO, "video")):
        n_runs = sum(run_kind == kind for _, _, run_kind in runs)
        if n_runs != len(items[kind]):
            raise ValueError(f"{n_runs} {name} token runs in input_ids but {len(items[kind])} {name} grids")


def _grid_positions(grid: np.ndarray, merge: int, interval: float, n_tokens: int) -> np.ndarray:
    """(3, t*h*w) positions of one vision run relative to its start, t-major like the vision tower's output."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    if t * h * w != n_tokens:
        raise ValueError(f"grid {grid.tolist()} merges to {t * h * w} tokens but its run has {n_tokens}")
    # HF computes float times and stores them in int64 ids, which truncates.
    times = (np.arange(t) * interval).astype(np.int64)
    axes = np.broadcast_arrays(times[:, None, None], np.arange(h)[None, :, None], np.arange(w)[None, None, :])
    return np.stack(axes).reshape(3, -1)
