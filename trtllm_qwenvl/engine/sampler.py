"""Token selection for the sampled rows of a step: greedy, temperature, top-k, top-p, per-request seeds."""
import torch

from ..utils.h2d import async_tensor_h2d
from .sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus; top_k 0 and top_p 1 leave a row untouched."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1, dtype=torch.float64)
    # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
    # Rows with top_p == 1 are exempt: rounding in the running sum would otherwise cut the far tail.
    drop |= ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def exponential_noise(shape, seqs: list[Sequence], device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            # Seeded requests draw on the host from their own generator, so results do not depend on batching.
            noise[row] = async_tensor_h2d(torch.empty(shape[1]).exponential_(generator=seq.generator),
                                          torch.float, device)
    return noise


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (B, V) fp32 -> token ids (B,). Work no row needs is skipped (the greedy argmax when no row is greedy,
    the division when every temperature is 1): at decode batch 1 each full-vocab pass costs about 10 us."""
    params = [seq.params for seq in seqs]
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    device = logits.device
    # Per-row settings go up through pinned memory: a plain torch.tensor(..., device=) would sync the step.
    temps = [p.temperature or 1.0 for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / async_tensor_h2d(temps, torch.float, device)[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):  # the full-vocab sort is the sampler's costliest op
        top_k = async_tensor_h2d([max(p.top_k, 0) for p in params], torch.long, device)
        top_p = async_tensor_h2d([p.top_p for p in params], torch.float, device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    # The exponential race argmax(p / q), q ~ Exp(1), taken in log space as argmax(logit - log q): the same draw
    # without the softmax, a full-vocab pass that at batch 1 took longer than the rest of the sampler together.
    sampled = (scaled - exponential_noise(scaled.shape, seqs, device).log()).argmax(-1)
    if not any(p.greedy for p in params):
        return sampled
    is_greedy = async_tensor_h2d([p.greedy for p in params], torch.bool, device)
    return torch.where(is_greedy, logits.argmax(dim=-1), sampled)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num: int) -> tuple[torch.Tensor, ...]:
    """Logprobs of the raw distribution: the sampled token's (B,), and the top `num` (B, num) ids and values."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_values, top_ids = logprobs.topk(num, dim=-1) if num else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_values
