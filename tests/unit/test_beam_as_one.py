"""Live beam groups stepped as one (``beam/scheduler/as_one.py``) inside a
real vLLM Scheduler: upstream's loop never walks the members, the beams stay
the host rule's, and a group that cannot be reserved, or whose member is
preempted, goes member by member with the same beams."""

from __future__ import annotations

import pickle

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus

from tests.unit.conftest import num_free_blocks
from tests.unit.test_beam_scheduler import PROMPT, host_search, root
from vllm_kvreuse.beam.plan import steps_of
from vllm_kvreuse.beam.result import decode
from vllm_kvreuse.beam.rule import BeamConfig
from vllm_kvreuse.core.upstream.extra_rows import extra_rows
from vllm_kvreuse.testing.fake_worker import model_output as made_up_output


def model_output(scheduler, output):
    """As a runner: rows that end a prefill short of the request's tokens
    (a preempted member recomputing) sample nothing."""
    requests = scheduler.requests
    sampling = {
        rid
        for rid in output.num_scheduled_tokens
        if rid not in requests or not requests[rid].is_prefill_chunk
    }
    return made_up_output(scheduler, output, sampling, 10)


def search(
    scheduler, width: int, max_tokens: int, preempt_at: int | None = None,
    plans: list | None = None, lora: LoRARequest | None = None,
):  # fmt: skip
    """Runs one group to its end; returns (beams, each step's extra rows, the
    group's members, whether it was stepped as one when it ended).
    ``plans``: gets each member step's private blocks (a ``GroupStep``'s);
    ``lora``: the root's adapter."""
    feature = scheduler.feature("beam")
    request = root(width, max_tokens)
    request.lora_request = lora
    scheduler.add_request(request)
    rows, outputs, members, as_one = [], [], [], False
    for step in range(100):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        pickle.dumps(output)  # what a multiprocess executor sends its workers
        rows.append(extra_rows(output))
        if plans is not None:
            plans += [s.blocks for s in steps_of(output) if s.kind in ("start", "step")]
        # Upstream's schedule() ran without every extra row's request.
        assert extra_rows(output) <= set(scheduler.kvreuse.holds.last_out[1])
        for group in feature.groups:
            members, as_one = list(group.members), group.as_one
        engine_outputs = scheduler.update_from_output(
            output, model_output(scheduler, output)
        )
        outputs += [o for eco in engine_outputs.values() for o in eco.outputs]
        for rid in rows[-1]:  # settled: nothing in flight between steps
            request = scheduler.requests.get(rid)
            assert request is None or request.num_in_flight_tokens == 0
        if step == preempt_at:
            preempted = scheduler.requests[members[1]]
            scheduler.kvreuse.upstream.preempt([preempted])
            assert preempted.status == RequestStatus.PREEMPTED
    (final,) = outputs
    beams = [(b.token_ids, b.cum_logprob) for b in decode(final.stop_reason).beams]
    return beams, rows, members, as_one


def expected(width: int, max_tokens: int):
    config = BeamConfig(width=width, max_tokens=max_tokens, eos_token_id=2)
    return host_search(PROMPT, config)


def test_members_are_rows_upstream_never_walks(make_scheduler) -> None:
    scheduler = make_scheduler()
    free = num_free_blocks(scheduler)
    beams, rows, members, as_one = search(scheduler, width=4, max_tokens=6)
    assert beams == expected(4, 6)
    assert as_one
    assert scheduler.feature("beam").as_one.num_taken == 1
    # Root prefill, then five steps whose every member row is an extra row,
    # the members' first included (admitted whole), then the members' ends.
    assert [bool(r) for r in rows[:7]] == [False, True, True, True, True, True, False]
    assert all(r == set(members) for r in rows[1:6])
    assert num_free_blocks(scheduler) == free


def test_members_are_admitted_whole_with_every_block_they_compute(
    make_scheduler,
) -> None:
    """The members' first step is admitted by the group, not upstream: one
    call for the whole width, each member's table then covering every
    position it computes (a search that ends in the block its members start
    in, 40 + 6 tokens: 2 blocks; one that crosses into a new block, 40 + 30:
    3 blocks), so nothing is reserved later. Both give the host rule's
    beams and every block back."""
    for max_tokens, num_blocks in ((6, 2), (30, 3)):
        scheduler = make_scheduler()
        free = num_free_blocks(scheduler)
        upstream, calls, reserved = scheduler.kvreuse.upstream, [], []
        admit = upstream.admit

        def counted(hits, num_positions, upstream=upstream, admit=admit, calls=calls):
            admitted = admit(hits, num_positions)
            tables = [upstream.block_ids_of(r.request_id)[0] for r, _, _ in hits]
            calls.append((admitted, {len(table) for table in tables}))
            return admitted

        upstream.admit = counted
        upstream.reserve = lambda request, num, reserved=reserved: reserved.append(1)
        beams, _, _, as_one = search(scheduler, 4, max_tokens)
        assert beams == expected(4, max_tokens)
        assert as_one and reserved == []
        assert calls == [(True, {num_blocks})]
        assert num_free_blocks(scheduler) == free


def test_the_last_step_names_no_blocks_to_copy(make_scheduler) -> None:
    """A step names each member's private blocks, for the workers to copy a
    moved beam's parent's; the last step's beams are final (no member
    computes their KV), so it names none. Stepped as one, and member by
    member (a pool too small to reserve 60 tokens' blocks)."""
    for num_blocks, max_tokens, as_one in ((64, 6, True), (14, 60, False)):
        scheduler, plans = make_scheduler(num_blocks=num_blocks), []
        beams, _, _, _ = search(scheduler, 4, max_tokens, plans=plans)
        assert beams == expected(4, max_tokens)
        assert scheduler.feature("beam").as_one.num_taken == int(as_one)
        assert len(plans) == max_tokens - 1  # tokens 2 .. max_tokens
        assert all(blocks and blocks[0] and all(blocks[0]) for blocks in plans[:-1])
        assert plans[-1] == []


def test_a_pool_too_small_to_reserve_goes_member_by_member(make_scheduler) -> None:
    """40 prompt tokens + 60: 1 shared block and 3 of each of 4 members' own,
    the least the frontend admits (``check_fits_pool``); at the members'
    first step the root's tail is still held, so 14 blocks (one null)
    cannot reserve the rest at once."""
    scheduler = make_scheduler(num_blocks=14)
    beams, rows, _, _ = search(scheduler, width=4, max_tokens=60)
    assert beams == expected(4, 60)
    assert scheduler.feature("beam").as_one.num_taken == 0
    assert not any(rows)


@pytest.mark.parametrize("preempt_at", [1, 2, 3])
def test_a_preempted_member_takes_its_group_back_to_upstreams_loop(
    make_scheduler, preempt_at: int
) -> None:
    """Preempted right after the members' first step (upstream's) is
    scheduled, after the first step stepped as one, or a step later: the
    beams built from the back-pointers are the host rule's."""
    scheduler = make_scheduler()
    free = num_free_blocks(scheduler)
    beams, rows, _, as_one = search(
        scheduler, width=4, max_tokens=8, preempt_at=preempt_at
    )
    assert beams == expected(4, 8)
    assert rows[preempt_at] or preempt_at == 1  # stepped as one, then not
    assert not any(rows[preempt_at + 2 :])
    assert not as_one
    assert num_free_blocks(scheduler) == free


def test_the_members_first_step_is_kept_as_back_pointers(make_scheduler) -> None:
    """The members' first step (upstream ran its rows) is recorded as the
    group's first back-pointers: no beam sequence is built for it."""
    scheduler = make_scheduler()
    feature = scheduler.feature("beam")
    scheduler.add_request(root(4, 6))
    for _ in range(2):  # the root's prefill, the members' first step
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_output(scheduler, output))
    (group,) = feature.groups
    assert group.as_one and group.step == 2
    assert group.lineage is not None and group.lineage.num_steps == 1
    # The beams are still the root step's: one token past the prompt.
    assert {len(beam.seq.tokens) for beam in group.beams} == {len(PROMPT) + 1}


def test_a_group_with_a_lora_adapter_goes_member_by_member(make_scheduler) -> None:
    """Held members are invisible to upstream's ``max_loras`` count: a
    group with an adapter is never stepped as one (its rows all go through
    upstream's loop), with the same beams."""
    scheduler = make_scheduler()
    free = num_free_blocks(scheduler)
    lora = LoRARequest("adapter", 1, "/nonexistent")
    beams, rows, _, as_one = search(scheduler, 4, 6, lora=lora)
    assert beams == expected(4, 6)
    assert not as_one and not any(rows)
    assert scheduler.feature("beam").as_one.num_taken == 0
    assert num_free_blocks(scheduler) == free
