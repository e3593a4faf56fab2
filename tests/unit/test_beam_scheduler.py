"""Engine-side beam groups inside a real vLLM Scheduler (no engine, no model)."""

from __future__ import annotations

from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from tests.unit.conftest import make_request, num_free_blocks
from vllm_kvreuse.beam.result import BeamOut, BeamResult, decode, encode
from vllm_kvreuse.beam.rule import Beam, BeamConfig, best, expand, logprob_row
from vllm_kvreuse.testing.fake_worker import made_up_logits
from vllm_kvreuse.testing.fake_worker import model_output as made_up_output

PROMPT = list(range(400, 440))  # 40 tokens: 1 full block + 8
VOCAB = 4096  # the tiny model's


def host_search(prompt: list[int], config: BeamConfig) -> list[tuple[list[int], float]]:
    """The host's rule (``rule.expand`` on rows cut in the canonical
    order) over the made-up logits: what the engine's beams must be."""
    beams = [Beam(BeamSearchSequence(None, list(prompt), []), "r")]
    done = []
    for _ in range(config.max_tokens):
        rows = []
        for beam in beams:
            lp = made_up_logits(beam.seq.tokens[-1], VOCAB).log_softmax(-1)
            values, tokens = lp.sort(descending=True, stable=True)
            size = config.num_logprobs
            rows.append(
                logprob_row(tokens[:size].tolist(), values[:size].tolist(), size)
            )
        step = expand(beams, rows, config)
        done += step.completed
        beams = [Beam(seq, f"b{i}") for i, (seq, _) in enumerate(step.beams)]
    final = best(done, [b.seq for b in beams], config)
    return [(seq.tokens[len(prompt) :], seq.cum_logprob) for seq in final]


def root(width: int = 2, max_tokens: int = 2):
    config = BeamConfig(width=width, max_tokens=max_tokens, eos_token_id=2)
    return make_request("root", PROMPT, max_tokens=1, kvreuse_beam=config.to_dict())


def model_output(scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """Every scheduled request samples; beam groups' steps run through the
    real worker code on made-up logits (:mod:`vllm_kvreuse.testing.fake_worker`)."""
    return made_up_output(scheduler, output, set(output.num_scheduled_tokens), 10)


def run(scheduler, max_steps: int = 20):
    """Steps to the end; returns (scheduled tokens per step, frontend outputs)."""
    scheduled, outputs = [], []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        scheduled.append(
            (dict(output.num_scheduled_tokens), output.kv_cache_block_copies)
        )
        engine_outputs = scheduler.update_from_output(
            output, model_output(scheduler, output)
        )
        outputs += [o for eco in engine_outputs.values() for o in eco.outputs]
    return scheduled, outputs


def test_group_runs_in_the_engine_and_returns_beams(make_scheduler) -> None:
    scheduler = make_scheduler()
    free_at_start = num_free_blocks(scheduler)
    scheduler.add_request(root())
    scheduled, outputs = run(scheduler)
    # Step 1: the root's prefill. Step 2: two beams, one token each, each
    # with its own copy of the root's partial tail block.
    assert scheduled[0][0] == {"root": 40}
    assert sorted(scheduled[1][0].values()) == [1, 1]
    assert len(scheduled[1][1]) == 2
    (final,) = outputs  # members' outputs never reach the frontend
    assert final.request_id == "root" and final.finish_reason == FinishReason.STOP
    assert final.kv_transfer_params is None  # P/D connectors' field, left alone
    result = decode(final.stop_reason)
    assert result is not None, final.stop_reason
    want = host_search(PROMPT, BeamConfig(width=2, max_tokens=2, eos_token_id=2))
    assert [(b.token_ids, b.cum_logprob) for b in result.beams] == want
    assert result.forks == 2
    assert num_free_blocks(scheduler) == free_at_start


def test_abort_of_the_root_frees_the_group(make_scheduler) -> None:
    scheduler = make_scheduler()
    free_at_start = num_free_blocks(scheduler)
    scheduler.add_request(root(max_tokens=5))
    for _ in range(2):  # root prefill, then the first beams
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_output(scheduler, output))
    scheduler.finish_requests("root", RequestStatus.FINISHED_ABORTED)
    assert scheduler.feature("beam").groups.is_empty() and not scheduler.kvreuse.ledger
    run(scheduler)
    assert num_free_blocks(scheduler) == free_at_start


def test_a_step_is_admitted_whole_or_not_at_all(make_scheduler) -> None:
    """8 blocks: a plain request holds 4, the root 2; a 4-beam step needs 4
    new tail blocks, so its members wait together until the plain request
    ends, instead of one member running while three wait for blocks."""
    scheduler = make_scheduler(num_blocks=8)
    free_at_start = num_free_blocks(scheduler)
    scheduler.add_request(make_request("plain", list(range(1000, 1120)), max_tokens=6))
    scheduler.add_request(root(width=4, max_tokens=3))
    scheduled, outputs = run(scheduler)
    members_per_step = [
        sum(1 for request_id in step if "-beam" in request_id) for step, _ in scheduled
    ]
    assert set(members_per_step) <= {0, 4}, members_per_step
    assert members_per_step.count(4) == 2  # tokens 2 and 3, each step whole
    finals = {o.request_id: o for o in outputs if o.finish_reason is not None}
    assert decode(finals["root"].stop_reason) is not None
    assert num_free_blocks(scheduler) == free_at_start


def test_live_members_share_the_prompt_hashes_and_hash_the_rest_privately(
    make_scheduler,
) -> None:
    """A live member's blocks of the root's prompt hash as anyone's; its
    blocks past them, whose content changes when it takes another beam,
    get hashes no request (no other member) can produce: no lookup finds
    them."""
    scheduler = make_scheduler()
    long_prompt = list(range(400, 470))  # 2 full blocks + 6
    config = BeamConfig(width=2, max_tokens=40, eos_token_id=2)
    request = make_request(
        "root", long_prompt, max_tokens=1, kvreuse_beam=config.to_dict()
    )
    scheduler.add_request(request)
    for _ in range(30):  # past the next block boundary (96 tokens)
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_output(scheduler, output))
    # Stepped as one, the members' histories are built when read.
    feature = scheduler.feature("beam")
    for group in feature.groups:
        feature.as_one.sync(group)
    members = [r for r in scheduler.requests.values() if "-beam" in r.request_id]
    assert members and members[0].num_tokens > 96
    private = []
    for member in members:
        fresh = make_request("fresh", list(member.all_token_ids))
        assert len(member.block_hashes) == len(fresh.block_hashes) == 3
        assert member.block_hashes[:2] == fresh.block_hashes[:2]
        assert member.block_hashes[2] != fresh.block_hashes[2]
        private.append(member.block_hashes[2])
    assert len(set(private)) == len(members)
    scheduler.finish_requests("root", RequestStatus.FINISHED_ABORTED)


def test_the_result_survives_its_trip_in_the_stop_reason() -> None:
    """Encoded into the root's stop reason and back, bit for bit (-inf too);
    an engine answer without the tag carries no result."""
    result = BeamResult(
        beams=[
            BeamOut([5, 2], -0.1 + -0.2, "stop", 2),
            BeamOut([7, 7], float("-inf"), "length", None),
        ],
        forks=4,
        copied_blocks=3,
        member_computed_tokens=9,
    )
    assert decode(encode(result)) == result
    assert decode("cache_threshold") is None and decode(None) is None
