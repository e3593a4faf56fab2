"""The seam to one request's private state in the scheduler.

A request's token lists (``_all_token_ids``, ``_output_token_ids``), its
block hasher and block hashes, its computed count, and its sampling
params' derived stop sets are changed only here (the seam's scheduler
side, :mod:`.scheduler`, exposes these as :class:`~.scheduler.Upstream`
steps). Each attribute is registered in
:data:`vllm_kvreuse.patches.upstream_state.UPSTREAM_STATE`.

Invariant: a request's block hashes always describe its tokens as its
hasher would hash them; a function that changes the tokens rehashes (or
cuts the hashes) before it returns.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request


def retoken(
    request: Request,
    tokens: list[int],
    num_computed: int,
    block_hashes: list[Any],
    sampling_params: SamplingParams | None,
) -> None:
    """Makes ``tokens`` the request's whole history and prompt, the first
    ``num_computed`` of them computed, as a streaming update leaves it."""
    request.prompt_token_ids = tokens.copy()
    request.num_prompt_tokens = len(tokens)
    request._all_token_ids[:] = tokens
    request._output_token_ids.clear()
    request.num_computed_tokens = num_computed
    request.spec_token_ids = []
    request.block_hashes = list(block_hashes)
    request.update_block_hashes()
    if sampling_params is not None:
        request.sampling_params = sampling_params


def rehash(request: Request, cache_salt: str | None) -> None:
    """Hashes the request's blocks anew under ``cache_salt`` (call while
    it holds no blocks: they would keep the old hashes)."""
    request.cache_salt = cache_salt
    request.block_hashes = []
    request.update_block_hashes()


def hasher_of(request: Request) -> Callable[[Request], list[Any]]:
    """The request's block hasher (the engine's), to build another
    request hashed the same way."""
    return request._block_hasher


def move_computed(request: Request, num_computed: int) -> None:
    """Sets the request's computed count (a KV connector loads the tokens
    it skips; the request is then sent whole: :mod:`vllm_kvreuse.core.resend`)."""
    request.num_computed_tokens = num_computed


def admitted(request: Request, num_computed: int) -> None:
    """A waiting request runs from its prefix hit of ``num_computed`` tokens
    (:meth:`.scheduler.Upstream.admit`), as ``schedule()`` leaves one it
    admits before its step's rows advance it."""
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_computed


_FINISHED = frozenset(s for s in RequestStatus if RequestStatus.is_finished(s))


def unfinished(requests: Iterable[Request]) -> list[Request]:
    """Those of ``requests`` not finished, in order (``is_finished`` costs
    two calls a request: a beam group puts hundreds back a step)."""
    return [r for r in requests if r.status not in _FINISHED]


def split_held(
    requests: Iterable[Request], held: Mapping[str, tuple[Request, Any]]
) -> tuple[list[Request], list[Request]]:
    """Those of ``requests`` that ``held`` holds (that very request, by its
    id), and the others, each in order: one pass (a queue of hundreds)."""
    taken: list[Request] = []
    kept: list[Request] = []
    for request in requests:
        entry = held.get(request.request_id)
        is_held = entry is not None and entry[0] is request
        (taken if is_held else kept).append(request)
    return taken, kept


def settle_rows(request: Request, num_row_tokens: int) -> None:
    """The request's step ran ``num_row_tokens`` of its scheduled tokens as
    row requests (:meth:`.scheduler.Upstream.split_rows`): upstream counted
    them in flight under the request and, finishing the step, takes back
    only what the request's own row ran; called just before it does."""
    request.num_in_flight_tokens -= num_row_tokens
    if request.num_stale_output_tokens > 0:  # preempted while in flight
        stale = min(num_row_tokens, request.num_stale_output_tokens)
        request.num_stale_output_tokens -= stale


def run_one_each(requests: Sequence[Request], fence: int | None) -> list[int]:
    """Each request's next position is scheduled outside upstream's loop
    (:mod:`.extra_rows`): advanced and counted in flight as upstream's
    ``_update_after_schedule`` does for a decoding row; ``fence``: the
    deferred-free step sequence, when upstream keeps one. Returns those
    positions (each computed count before). One loop for all: a beam
    group's members are hundreds a step."""
    positions = []
    for request in requests:
        position = request.num_computed_tokens
        positions.append(position)
        request.num_computed_tokens = position + 1
        request.num_in_flight_tokens += 1
        request.is_prefill_chunk = False
        if fence is not None:
            request.last_sched_seq = fence
    return positions


def settle_one_each(requests: Iterable[Request]) -> None:
    """:func:`settle_rows` of one token for each of ``requests`` (the rows
    :func:`run_one_each` ran), in one loop."""
    for request in requests:
        request.num_in_flight_tokens -= 1
        if request.num_stale_output_tokens > 0:  # preempted while in flight
            request.num_stale_output_tokens -= 1


def history(request: Request, start: int) -> list[int]:
    """A copy of the request's tokens from ``start`` on."""
    return request._all_token_ids[start:]


def adopt(
    request: Request,
    start: int,
    length: int,
    history: list[int] | None,
    token: int,
) -> None:
    """Makes the request's tokens ``start .. length`` ``history`` (another
    request's; None: its own stay), and the token at ``length``
    ``token``: the sample the step appended, appended here if upstream
    dropped it (a preempted request's output in flight, dropped by a
    cache reset). Prompt and output lists are rewritten where each
    holds those positions; computed counts, blocks and hashes stay (the
    workers copied the KV; blocks past ``start`` hash privately)."""
    tokens = request._all_token_ids
    assert len(tokens) >= length, "a step's token count went back"
    num_prompt = request.num_prompt_tokens
    if history is not None:
        assert len(history) == length - start, "histories of two lengths"
        tokens[start:length] = history
        prompt = request.prompt_token_ids
        if prompt is not None and num_prompt > start:
            prompt[start:num_prompt] = history[: num_prompt - start]
        first = max(num_prompt, start)
        request._output_token_ids[first - num_prompt : length - num_prompt] = history[
            first - start :
        ]
    if len(tokens) == length:
        request.append_output_token_ids(token)
    elif tokens[length] != token:
        tokens[length] = token
        request._output_token_ids[length - num_prompt] = token


def rewrite(request: Request, start: int, tokens: list[int]) -> None:
    """Makes the request's tokens ``tokens`` (which agree with its own
    before ``start``, and are at least as many), the rest appended as
    upstream appends a sample (block hashes included). Computed counts and
    blocks stay (the workers hold that KV)."""
    all_tokens = request._all_token_ids
    num, num_prompt = len(all_tokens), request.num_prompt_tokens
    assert len(tokens) >= num > start, "a rewrite shortens the request"
    all_tokens[start:num] = tokens[start:num]
    prompt = request.prompt_token_ids
    if prompt is not None and num_prompt > start:  # a member's first beam
        prompt[start:num_prompt] = tokens[start:num_prompt]
    first = max(num_prompt, start)
    request._output_token_ids[first - num_prompt :] = tokens[first:num]
    if len(tokens) > num:
        request.append_output_token_ids(tokens[num:])


def unsample(request: Request, hash_block_size: int) -> None:
    """Takes back the request's last sampled token and the hash of a
    block it completed: it will compute that position again."""
    request._all_token_ids.pop()
    if request._output_token_ids:
        request._output_token_ids.pop()
    del request.block_hashes[request.num_tokens // hash_block_size :]


def never_stop(sampling: SamplingParams) -> None:
    """Clears every stop condition of ``sampling`` (a live beam member stops
    only when its group aborts it), the derived EOS sets included."""
    sampling.min_tokens = 0
    sampling.stop_token_ids = None
    sampling._eos_token_id = None
    sampling._all_stop_token_ids = set()


def share_block_hashes(
    request: Request,
    root: Request,
    num_hashes: int,
    private_block_size: int | None = None,
) -> None:
    """Gives ``request`` ``root``'s first ``num_hashes`` block hashes and
    hasher, then hashes its blocks past them (hashes chain, so the hasher
    continues from the last one). With ``private_block_size`` (the hash
    block size) every later block gets a random hash instead, which no
    request's lookup can match: its content may change while it is cached."""
    request.block_hashes = root.block_hashes[:num_hashes]
    if private_block_size is None:
        request._block_hasher = root._block_hasher
    else:
        request._block_hasher = _private_hasher(private_block_size)
    request.update_block_hashes()


@functools.cache  # one per size: a wide beam group's members share it
def _private_hasher(hash_block_size: int) -> Callable[[Request], list[Any]]:
    def hasher(request: Request) -> list[Any]:
        """Random hashes for the request's full blocks that have none yet."""
        blocks = request.num_tokens // hash_block_size
        return [os.urandom(32) for _ in range(blocks - len(request.block_hashes))]

    return hasher
