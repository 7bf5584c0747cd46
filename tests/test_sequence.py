"""Serving Sequence: token bookkeeping, why a request finishes, preemption by recompute, validation."""

import pytest

from k3.serve.sampling import SamplingParams
from k3.serve.sequence import FinishReason, Sequence, SequenceStatus, end_reason, ending_token_ids

EOS = 2


def test_token_bookkeeping():
    seq = Sequence("r0", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=1.5)
    assert seq.status == SequenceStatus.WAITING and seq.finish_reason is None and seq.arrival_time == 1.5
    assert seq.num_prompt_tokens == 3 and seq.num_output_tokens == 0 and seq.last_token_id == 7
    assert seq.remaining_prefill == 3 and seq.error is None
    seq.num_computed_tokens = 3
    assert seq.append_token(9, EOS) is None
    assert seq.all_token_ids == [5, 6, 7, 9] and seq.num_tokens == 4 and seq.last_token_id == 9
    assert seq.remaining_prefill == 1  # the sampled token is not in the cache yet
    seq.append_token(8, EOS)
    for start in range(6):
        for end in range(start, 6):
            assert seq.token_ids(start, end) == seq.all_token_ids[start:end]
    assert FinishReason.LENGTH == "length" and FinishReason.STOP.value == "stop"


def test_finish_on_eos():
    seq = Sequence("r", [1, 3], SamplingParams(max_tokens=10))
    assert seq.append_token(4, EOS) is None
    assert seq.append_token(EOS, EOS) == FinishReason.STOP
    assert seq.is_finished and seq.status == SequenceStatus.FINISHED and seq.output_token_ids == [4, EOS]
    with pytest.raises(RuntimeError, match="is finished"):
        seq.append_token(4, EOS)


def test_ignore_eos_runs_to_length():
    seq = Sequence("r", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [seq.append_token(EOS, EOS) for _ in range(3)] == [None, None, FinishReason.LENGTH]
    assert seq.finish_reason == FinishReason.LENGTH


def test_stop_token_ids():
    seq = Sequence("r", [1], SamplingParams(max_tokens=5, stop_token_ids=[11, 12], ignore_eos=True))
    assert seq.append_token(10, None) is None
    assert seq.append_token(12, None) == FinishReason.STOP


def test_max_tokens_and_no_eos_id():
    seq = Sequence("r", [1], SamplingParams(max_tokens=2))
    assert seq.append_token(EOS, None) is None  # no eos id given: eos is an ordinary token
    assert seq.append_token(3, None) == FinishReason.LENGTH


def test_finish_first_reason_sticks():
    seq = Sequence("r", [1])
    seq.finish(FinishReason.ABORT)
    seq.finish(FinishReason.STOP)
    assert seq.finish_reason == FinishReason.ABORT and seq.is_finished


def test_reset_for_recompute():
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    seq.status, seq.num_computed_tokens, seq.num_cached_tokens = SequenceStatus.RUNNING, 4, 2
    seq.latent_pages, seq.state_pages = [3, 8], [5, 6, 7]
    seq.append_token(9, EOS)
    seq.num_computed_tokens = 5

    assert seq.reset_for_recompute() == [3, 8, 5, 6, 7]
    assert seq.latent_pages == [] and seq.state_pages == []
    assert seq.num_computed_tokens == 0 and seq.status == SequenceStatus.PREEMPTED
    assert seq.all_token_ids == [1, 2, 3, 4, 9] and seq.remaining_prefill == 5  # output is recomputed too
    assert seq.num_cached_tokens == 2
    assert seq.reset_for_recompute() == []
    seq.finish(FinishReason.ABORT)
    with pytest.raises(RuntimeError, match="nothing to recompute"):
        seq.reset_for_recompute()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ([1, -1], r"prompt token ids must be non-negative ints, got -1 at position 1"),
        ([1, 2.0], "prompt token ids must be non-negative ints, got 2.0"),
        ([True], "prompt token ids must be non-negative ints"),
    ],
)
def test_validation(prompt, message):
    with pytest.raises(ValueError, match=message):
        Sequence("r", prompt)


def test_append_validates_token():
    seq = Sequence("r", [1])
    with pytest.raises(ValueError, match="token ids must be non-negative ints"):
        seq.append_token(-3, EOS)
    assert seq.output_token_ids == []


def test_append_output_streams_text_and_stops_at_a_stop_string():
    """The request's own text stream: detokenised per token, a possible start of a stop string held back,
    the stop string cut and the request finished when it completes."""
    from k3.formats.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    seq = Sequence("r", [1], SamplingParams(max_tokens=20, stop=["\n\n"]), tokenizer=tok)
    pieces = []
    for t in tok.encode("ab\ncd\n\nef"):
        pieces.append(seq.append_output(t))
        if seq.is_finished:
            break
    assert "".join(pieces) == seq.output_text == "ab\ncd"
    assert pieces[2] == "" and pieces[3] == "\nc"  # "\n" held back until "c" shows it starts no stop string
    assert seq.finish_reason == FinishReason.STOP and seq.num_output_tokens == 7


def test_end_reason_is_the_one_rule():
    """Stop on eos (unless ignore_eos), a stop token id or a complete grammar, before length at max_tokens."""
    p = SamplingParams(max_tokens=3, stop_token_ids=[9])
    assert end_reason(p, EOS, 1, EOS) == end_reason(p, 9, 1, None) == FinishReason.STOP
    assert end_reason(p, 4, 2, EOS) is None and end_reason(p, 4, 3, EOS) == FinishReason.LENGTH
    assert end_reason(p, EOS, 3, EOS) == FinishReason.STOP  # on the max_tokens-th token too
    assert end_reason(p, 4, 1, EOS, grammar_complete=True) == FinishReason.STOP
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert end_reason(ignoring, EOS, 1, EOS) is None and ending_token_ids(ignoring, EOS) == ()
    assert ending_token_ids(p, EOS) == (EOS, 9) and ending_token_ids(p, None) == (9,)


def test_a_stop_string_completed_by_the_last_token_ends_with_stop():
    """The max_tokens-th token completes a stop string: the output is cut there and the request ends with
    stop, the reason the chat server gives for a cut content (and vLLM for a cut output); it said length."""
    from k3.formats.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    ids = tok.encode("ab\n\n")
    seq = Sequence("r", [1], SamplingParams(max_tokens=len(ids), stop=["\n\n"]), tokenizer=tok)
    text = "".join(seq.append_output(t) for t in ids)
    assert text == seq.output_text == "ab" and seq.finish_reason == FinishReason.STOP
    assert seq.num_output_tokens == len(ids)
