"""SFT data: assistant-only loss mask, truncation, packing (same per-sample loss through a real model),
collation, pre-built indexed sets and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.data.chat import tokenize_conversation
from rlhf.data.packing import pack_lengths
from rlhf.data.sft import SFTDataset, collate_sft
from rlhf.data.sft_indexed import preprocess_sft
from rlhf.errors import UserError
from tests.helpers.files import write_lines
from workers.roles.lm import lm_attention_mask

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "What is 10+7?"},
            {"from": "gpt", "value": "The answer is 17"},
            {"from": "human", "value": "and 1+1?"},
            {"from": "gpt", "value": "2"},
        ]
    },
    {
        "system": "You add numbers.",
        "conversations": [{"from": "human", "value": "What is 40+2?"}, {"from": "gpt", "value": "42"}],
    },
    {
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hello world, this is the model"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is 99+99? Please think step by step."},
            {"role": "assistant", "content": "99 plus 99 is 198. The answer is 198."},
        ]
    },
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two three"}]},
]


def _assistant_turns(record: dict) -> list[str]:
    turns = record.get("messages") or record["conversations"]
    return [
        t.get("content", t.get("value"))
        for t in turns
        if t.get("role", t.get("from")) in ("assistant", "gpt")
    ]


@pytest.fixture
def sft_file(tmp_path):
    return write_lines(tmp_path / "sft.jsonl", CONVERSATIONS)


def test_loss_mask_is_exactly_the_assistant_tokens(sft_file, tok_dir, tokenizer):
    ds = SFTDataset(sft_file, tok_dir, seq_length=128)
    assert len(ds) == len(CONVERSATIONS) and ds.num_skipped == 0
    for i, record in enumerate(CONVERSATIONS):
        item = ds[i]
        trained = item["labels"][item["loss_mask"] == 1].tolist()
        expected = []
        for content in _assistant_turns(record):
            expected += tokenizer(content)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        assert trained == expected, tokenizer.decode(trained)
        # and nothing else: every unmasked label is outside the assistant spans
        assert item["loss_mask"].sum() == len(expected)
        assert torch.equal(item["tokens"][1:], item["labels"][:-1])
        assert item["position_ids"].tolist() == list(range(item["tokens"].numel()))


def test_mask_without_generation_markers_matches(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    for record in CONVERSATIONS:
        turns = record.get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
            for t in record["conversations"]
        ]
        assert tokenize_conversation(plain, turns) == tokenize_conversation(tokenizer, turns)


def test_truncation_and_skipping(sft_file, tok_dir):
    with pytest.warns(
        UserWarning, match="skipped 3 conversations with no assistant token within seq_length 20"
    ):
        ds = SFTDataset(sft_file, tok_dir, seq_length=20)
    assert all(ds[i]["tokens"].numel() <= 20 for i in range(len(ds)))
    assert ds.num_skipped >= 1 and len(ds) + ds.num_skipped == len(CONVERSATIONS)
    assert all(ds[i]["loss_mask"].sum() > 0 for i in range(len(ds)))


def _with_mask(batch: dict) -> dict:
    """The batch plus the mask the worker builds from its positions and the segment bounds over the
    flattened batch (a segment starts wherever its position is 0; padding is one more segment)."""
    pos = batch["position_ids"]
    bounds = (pos.flatten() == 0).nonzero().flatten().tolist() + [pos.numel()]
    return dict(batch, attention_mask=lm_attention_mask(pos), cu_seqlens=torch.tensor(bounds))


def _per_sample_losses(model, batch) -> list[float]:
    """Sum of the masked token losses of each packed segment, from one forward with the 4D mask."""
    mask = torch.zeros(batch["attention_mask"].shape, dtype=torch.float32)
    mask[batch["attention_mask"]] = torch.finfo(torch.float32).min
    with torch.no_grad():
        logits = model(
            input_ids=batch["tokens"], attention_mask=mask, position_ids=batch["position_ids"]
        ).logits
    tok_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    tok_loss = (tok_loss * batch["loss_mask"]).flatten()
    cu = batch["cu_seqlens"].tolist()
    return [float(tok_loss[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])]


def test_packing_keeps_each_sample_loss(sft_file, tok_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tok_dir, dtype=torch.float32).eval()
    unpacked = SFTDataset(sft_file, tok_dir, seq_length=96)
    packed = SFTDataset(sft_file, tok_dir, seq_length=96, pack=True)
    assert len(packed) < len(unpacked) and sum(len(r) for r in packed.rows) == len(unpacked)
    reference = []
    for i in range(len(unpacked)):
        item = unpacked[i]
        with torch.no_grad():
            logits = model(input_ids=item["tokens"][None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, item["labels"], reduction="none")
        reference.append(float((loss * item["loss_mask"]).sum()))
    batch = _with_mask(packed.collate([packed[j] for j in range(len(packed))]))
    assert batch["attention_mask"].shape == (len(packed), 1, 96, 96)
    losses = _per_sample_losses(model, batch)
    got = {}
    k = 0
    for row in packed.rows:
        for i in row:
            got[i] = losses[k]
            k += 1
        k += 1 if sum(packed.lengths[i] for i in row) < 96 else 0  # the padding segment
    assert min(reference) > 1.0  # real, non-trivial losses
    for i, ref in enumerate(reference):
        assert got[i] == pytest.approx(ref, rel=1e-5, abs=1e-5), i
    # control: with a plain causal mask the later samples of a row see earlier ones, and losses change
    causal = dict(
        batch,
        attention_mask=torch.ones(96, 96, dtype=torch.bool).triu(1)[None, None].expand(len(packed), 1, 96, 96),
    )
    assert max(abs(a - b) for a, b in zip(_per_sample_losses(model, causal), losses)) > 1e-3


def test_collate_shapes(sft_file, tok_dir):
    ds = SFTDataset(sft_file, tok_dir, seq_length=64)
    batch = collate_sft([ds[0], ds[1]], ds.pad_id)
    width = max(ds.lengths[0], ds.lengths[1])
    assert batch["tokens"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, width)
    assert batch["loss_mask"].dtype == torch.float32 and batch["tokens"].dtype == torch.long
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    n0, n1 = ds.lengths[0], ds.lengths[1]
    assert n0 < n1 == width
    assert batch["position_ids"][0].tolist() == list(range(n0)) + list(range(width - n0))
    assert batch["loss_mask"][0, n0:].sum() == 0 and (batch["tokens"][0, n0:] == ds.pad_id).all()
    fixed = ds.collate([ds[0]])
    assert fixed["tokens"].shape == (1, 64)


def test_packing_helpers():
    lengths = [5, 9, 3, 7, 1, 10, 4]
    bins = pack_lengths(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins) and len(bins) == 4
    m = lm_attention_mask(torch.tensor([[0, 1, 0, 1, 2, 0]]))[0, 0]  # segments 2, 3 and 1 padding
    allowed = ~m
    assert allowed[1, 0] and not allowed[2, 1] and allowed[4, 2] and not allowed[2, 3] and allowed[5, 5]
    assert not allowed[5, 4]  # the padding position is its own block


@pytest.mark.parametrize("workers", [1, 2])
def test_prebuilt_indexed_set_matches_jsonl(sft_file, tok_dir, tmp_path, workers):
    bad = write_lines(
        tmp_path / "mixed.jsonl", [*CONVERSATIONS[:3], "oops", {"messages": []}, *CONVERSATIONS[3:]]
    )
    prefix, stats = preprocess_sft(
        bad, tmp_path / "sft", tok_dir, seq_length=96, workers=workers, progress=False
    )
    assert stats.docs == len(CONVERSATIONS) and stats.malformed == 2
    from_jsonl = SFTDataset(sft_file, tok_dir, seq_length=96)
    indexed = SFTDataset(prefix, tok_dir, seq_length=96, pack=True)
    flat = SFTDataset(prefix, tok_dir, seq_length=96)
    for i in range(len(from_jsonl)):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(flat[i][key], from_jsonl[i][key])
    assert len(indexed) < len(flat)
    with pytest.warns(UserWarning, match="skipped"):
        shorter = SFTDataset(prefix, tok_dir, seq_length=20)
        assert shorter.num_skipped == SFTDataset(sft_file, tok_dir, seq_length=20).num_skipped == 3


def test_bad_sft_input(tmp_path, tok_dir):
    f = write_lines(tmp_path / "bad.jsonl", [CONVERSATIONS[0], "{broken"])
    with pytest.raises(UserError, match=rf"{f}:2: not valid JSON"):
        SFTDataset(f, tok_dir, 64)
    f = write_lines(tmp_path / "role.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(UserError, match=rf"{f}:1: turn 0 has role 'robot'"):
        SFTDataset(f, tok_dir, 64)
    f = write_lines(tmp_path / "noassistant.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UserError, match="no assistant turn"):
        SFTDataset(f, tok_dir, 64)
    with pytest.raises(UserError, match="does not exist"):
        SFTDataset(tmp_path / "none.jsonl", tok_dir, 64)
    with pytest.raises(UserError, match="tokenizer folder"):
        SFTDataset(f, tmp_path / "no_tok", 64)
    with pytest.raises(UserError, match="seq_length"):
        SFTDataset(f, tok_dir, 0)


def test_packing_keeps_each_sample_loss_through_megatron(sft_file, tok_dir):
    """The packed batch as the Megatron engine consumes it: local spec, bool [B,1,S,S] mask on CPU."""
    from tests.data.mcore_sft_fns import packed_and_unpacked_losses
    from workers.megatron.launch import run_distributed

    packed = SFTDataset(sft_file, tok_dir, seq_length=96, pack=True)
    batch = _with_mask(packed.collate([packed[j] for j in range(len(packed))]))
    order = [i for row in packed.rows for i in row]
    samples = [packed.sample(i) for i in order]
    got, alone = run_distributed(packed_and_unpacked_losses, 1, args=(tok_dir, batch, samples))[0]
    segments = []  # per-segment losses without the padding segments
    k = 0
    for row in packed.rows:
        segments += got[k : k + len(row)]
        k += len(row) + (1 if sum(packed.lengths[i] for i in row) < 96 else 0)
    assert min(alone) > 1.0
    assert segments == pytest.approx(alone, rel=1e-5, abs=1e-5)


def test_tool_trace_mask_is_the_assistant_turns_and_matches_the_agent_loop(tmp_path, tok_dir, tokenizer):
    """A two-turn tool trace (call -> tool result -> answer): the loss covers exactly the two assistant
    turns (content + end of turn), never the tool result or the template glue; the ids are those the agent
    loop builds (prompt, the model's tokens, its `_turn_ids` glue, the model's answer); OpenAI `tool_calls`
    render as the same text."""
    from rlhf.data.tool_tasks import call_text, trace_record
    from workers.agent.loop import _turn_ids
    from workers.agent.toolcalls import parse_tool_calls

    record = trace_record(123, 456)
    openai = copy.deepcopy(record)
    openai["messages"][1] = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "123*456"}'}}]}
    ds = SFTDataset(write_lines(tmp_path / "trace.jsonl", [record, openai]), tok_dir, seq_length=256)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call, answer = call_text("123*456"), "56088"
    assert [(c.name, c.arguments) for c in parse_tool_calls(call)] == [("calculator", {"expression": "123*456"})]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for i in range(2):
        item = ds[i]
        trained = item["labels"][item["loss_mask"] == 1].tolist()
        assert trained == enc(call) + [eot] + enc(answer) + [eot], tokenizer.decode(trained)
        # the agent loop's token ids: the prompt (with the record's tool schemas), turn 1, the glue with the
        # tool result, turn 2
        msgs = record["messages"]
        prompt = tokenizer.apply_chat_template(msgs[:1], tools=record.get("tools"), tokenize=True,
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
        loop_ids = list(prompt) + enc(call) + _turn_ids(tokenizer, msgs[:2], msgs[2:3]) + enc(answer) + [eot]
        ids = [int(item["tokens"][0])] + item["labels"].tolist()
        assert ids[: len(loop_ids)] == loop_ids
    bad = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "x"}}]}]}
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "not json"
    with pytest.raises(UserError, match=r"bad.jsonl:1: turn 1: a tool call needs a string name and object"):
        SFTDataset(write_lines(tmp_path / "bad.jsonl", [bad]), tok_dir, seq_length=64)
