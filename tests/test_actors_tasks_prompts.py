"""Built-in tasks and prompt sources (task, JSONL file, data set directory)."""

import json

import pytest
from transformers import AutoTokenizer

from actors.prompts import ChatRenderer, PromptStream, load_records, make_prompt_stream, read_dataset_dir
from actors.tasks import COUNT_TARGET, LENGTH_RANGE, TASKS, examples, positional_match, score
from async_rlhf.config import ConfigError, DataConfig
from async_rlhf.types import Prompt


def _prompt(text, answer):
    return Prompt("p", (1,), text, answer)


def test_examples_are_deterministic_and_seeded():
    for task in TASKS:
        assert examples(task, 0, 5) == examples(task, 0, 5)
        assert examples(task, 0, 5) != examples(task, 1, 5)
        text, answer = examples(task, 0, 1)[0]
        assert text.startswith(task + " ") and answer
        assert text.endswith(answer if task == "pick" else "=")  # pick's letter comes last


def test_count_reward():
    p = _prompt("count a: 123=", "a" * COUNT_TARGET)
    assert score([p] * 4, ["", "aa", "abab" * 4, "a" * 20]) == [0.0, 0.25, 1.0, 1.0]


def test_copy_and_reverse_rewards():
    copy, rev = _prompt("copy 3142=", "3142"), _prompt("reverse 3142=", "2413")
    assert score([copy, rev], ["3142", " 2413 "]) == [1.0, 1.0]
    assert positional_match("31", "3142") == pytest.approx(0.4)  # two of four digits, wrong length
    assert positional_match("3199", "3142") == pytest.approx(0.6)
    assert positional_match("x" * 16, "3142") == 0.0
    assert all(0.0 <= r <= 1.0 for r in score([copy] * 3, ["", "3142314231423142", "zz"]))


def test_length_task_spans_the_range_and_rewards_the_stated_length():
    targets = [int(answer) for split in ("train", "heldout") for _, answer in examples("length", 0, 2000, split)]
    assert (min(targets), max(targets)) == LENGTH_RANGE  # widely varying response lengths
    p = _prompt("length 20=", "20")
    assert score([p] * 4, ["x" * 20, "x" * 10, "x" * 30, "x" * 60]) == [1.0, 0.5, 0.5, 0.0]


def test_other_prompts_use_exact_match_or_refuse():
    assert score([_prompt("2+2?", "4")] * 2, ["4 ", "5"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="has no answer to match"):
        score([_prompt("hello", "")], ["x"])


@pytest.fixture(scope="module")
def tok(tiny_actor_model):
    return AutoTokenizer.from_pretrained(tiny_actor_model)


def test_task_stream_epochs_shuffle_deterministically(tok):
    records = [("copy 1=", "1"), ("copy 2=", "2"), ("copy 3=", "3")]
    a = PromptStream(records, tok, seed=5)
    first, second = a.take(3), a.take(3)
    assert sorted(p.prompt_id for p in first) == sorted(p.prompt_id for p in second)  # epochs
    assert a.epoch == 1
    b = PromptStream(records, tok, seed=5)
    assert [p.prompt_id for p in b.take(6)] == [p.prompt_id for p in first + second]
    other = PromptStream(records * 10, tok, seed=5, stream=1)  # another generator's order
    same_seed = PromptStream(records * 10, tok, seed=5)
    assert [p.prompt_id for p in other.take(30)] != [p.prompt_id for p in same_seed.take(30)]
    p = first[0]
    assert p.token_ids[0] == tok.bos_token_id and tok.decode(p.token_ids, skip_special_tokens=True) == p.text


def test_stream_seeks_to_a_position_as_if_it_had_taken_that_many(tok):
    records = [(f"copy {i}=", str(i)) for i in range(5)]
    ref = PromptStream(records, tok, seed=3, stream=1)
    taken = [p.prompt_id for p in ref.take(13)]  # two epochs and a half
    assert ref.position == 13
    for position in (0, 4, 5, 6, 10, 12):
        resumed = PromptStream(records, tok, seed=3, stream=1)
        resumed.seek(position)
        assert resumed.position == position
        assert [p.prompt_id for p in resumed.take(13 - position)] == taken[position:]
    with pytest.raises(ValueError, match="position must be >= 0, got -1"):
        ref.seek(-1)


def test_task_source(tok):
    stream = make_prompt_stream(DataConfig(source="task", task="count"), tok, seed=0)
    p = next(stream)
    assert p.text.startswith("count a:") and p.prompt_id.startswith("count:")
    with pytest.raises(ValueError, match="unknown task 'bogus'"):
        load_records(DataConfig(task="bogus"))


def test_jsonl_source(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "copy 12=", "a": "12"}\n\n{"q": "copy 7=", "a": 7}\n')
    cfg = DataConfig(source="jsonl", path=str(path), prompt_key="q", answer_key="a")
    assert load_records(cfg) == [("copy 12=", "12"), ("copy 7=", "7")]
    stream = make_prompt_stream(cfg, tok)
    got = stream.take(4)
    assert {p.answer for p in got} == {"12", "7"} and got[0].prompt_id.startswith("p:")
    path.write_text('{"prompt": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2 is not valid JSON"):
        load_records(DataConfig(source="jsonl", path=str(path)))
    path.write_text('{"text": "x"}\n')
    with pytest.raises(KeyError, match="has no 'prompt' field"):
        load_records(DataConfig(source="jsonl", path=str(path)))


def test_prompts_over_the_context_are_skipped_with_the_fix_named(tok, caplog):
    records = [("copy 12=", "12"), ("copy " + "7" * 40 + "=", ""), ("copy 3=", "3")]
    stream = PromptStream(records, tok, name="p", max_tokens=20)
    assert sorted(p.text for p in stream.prompts) == ["copy 12=", "copy 3="]
    assert "1 of 3 prompts of p are longer than 20 tokens" in caplog.text
    assert "lower generator.max_new_tokens" in caplog.text
    with pytest.raises(ValueError, match=r"3 of 3 prompts .* none is left; shorten the prompts"):
        PromptStream(records, tok, name="p", max_tokens=3)


def test_dataset_directory_of_jsonl(tmp_path, tok):
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "copy 2=", "answer": "2"}) + "\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "copy 1=", "answer": "1"}) + "\n")
    assert [r["prompt"] for r in read_dataset_dir(tmp_path)] == ["copy 1=", "copy 2="]
    stream = make_prompt_stream(DataConfig(source="hf_dataset", path=str(tmp_path)), tok)
    assert len(stream.prompts) == 2
    with pytest.raises(FileNotFoundError, match="data set directory .* not found"):
        read_dataset_dir(tmp_path / "a.jsonl")  # not a directory
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no \\*.jsonl files"):
        read_dataset_dir(empty)


def test_save_to_disk_directory(tmp_path, tok):
    import datasets

    data = datasets.Dataset.from_dict({"prompt": ["copy 5=", "copy 6="], "answer": ["5", "6"]})
    datasets.DatasetDict({"train": data}).save_to_disk(str(tmp_path / "ds"))
    stream = make_prompt_stream(DataConfig(source="hf_dataset", path=str(tmp_path / "ds")), tok)
    assert sorted(p.answer for p in stream.prompts) == ["5", "6"]


def test_echo_reward():
    p = _prompt("echo 7=", "7")
    assert score([p] * 3, ["", "7a7", "7" * 9]) == [0.0, 0.25, 1.0]


@pytest.fixture(scope="module")
def bpe(bpe_actor_model):
    return AutoTokenizer.from_pretrained(bpe_actor_model)


CONVERSATION = [{"role": "system", "content": "Answer with a's."}, {"role": "user", "content": "count a: 48="}]


def test_conversations_render_with_the_chat_template_and_rewards_see_the_messages(tmp_path, bpe):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": CONVERSATION, "answer": "aaaaaaaa"}) + "\n"
                    + json.dumps({"prompt": "count a: 7=", "answer": "aaaaaaaa"}) + "\n")
    stream = make_prompt_stream(DataConfig(source="jsonl", path=str(path)), bpe, seed=0)
    chat, plain = sorted(stream.prompts, key=lambda p: p.prompt_id)
    assert chat.text == ("<bos><|im_start|>system\nAnswer with a's.<|im_end|>\n<|im_start|>user\n"
                         "count a: 48=<|im_end|>\n<|im_start|>assistant\n")
    assert chat.token_ids == tuple(bpe(chat.text, add_special_tokens=False)["input_ids"])
    assert bpe.convert_ids_to_tokens(chat.token_ids[:2]) == ["<bos>", "<|im_start|>"]
    assert chat.messages == tuple(CONVERSATION) and chat.query == "count a: 48="
    assert plain.text == "count a: 7=" and plain.messages == ()  # auto: plain strings stay plain
    assert plain.token_ids == tuple(bpe("count a: 7=")["input_ids"])
    assert score([chat, plain], ["aaaa", "aaaaaaaa"]) == [0.5, 1.0]  # by the user's words


def test_system_prompt_and_forced_template_and_a_jinja_file(tmp_path, bpe, tok):
    data = DataConfig(task="count", system_prompt="Be brief.", chat_template="on")
    prompt = make_prompt_stream(data, bpe, seed=0).take(1)[0]
    assert prompt.text.startswith("<bos><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ncount a: ")
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    jinja = tmp_path / "plain.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}=> ")
    prompt = make_prompt_stream(DataConfig(task="count", chat_template=str(jinja)), tok, seed=0).take(1)[0]
    assert prompt.text.startswith("[user] count a: ") and prompt.text.endswith(" => ")
    # a tokenizer without a template cannot render a conversation: the error names the fix
    with pytest.raises(ValueError, match="no chat template: set data.chat_template"):
        PromptStream([(CONVERSATION, "")], tok)
    with pytest.raises(ValueError, match="data.chat_template=off"):
        PromptStream([(CONVERSATION, "")], bpe, render=ChatRenderer(bpe, "off"))


def test_malformed_conversations_and_settings_are_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"record 0 of .*: message 0 must be a \{'role': str"):
        load_records(DataConfig(source="jsonl", path=str(path)))
    with pytest.raises(ConfigError, match="data.chat_template must be auto, on, off or an existing Jinja file"):
        DataConfig(chat_template="nope.jinja")
    with pytest.raises(ConfigError, match="data.system_prompt must be empty with data.chat_template=off"):
        DataConfig(system_prompt="x", chat_template="off")


def test_chat_template_kwargs_reach_the_template(tmp_path, bpe):
    """Qwen3's template writes an empty think block when enable_thinking is false."""
    jinja = tmp_path / "thinking.jinja"
    jinja.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                     "{% endfor %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
    plain = DataConfig(task="count", chat_template=str(jinja))
    thinking = make_prompt_stream(plain, bpe, seed=0).take(1)[0]
    quiet = make_prompt_stream(DataConfig(task="count", chat_template=str(jinja),
                                          chat_template_kwargs={"enable_thinking": False}), bpe, seed=0).take(1)[0]
    assert quiet.text == thinking.text + "<think>\n\n</think>\n\n"
    assert quiet.token_ids == tuple(bpe(quiet.text, add_special_tokens=False)["input_ids"])
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs must be empty with data.chat_template=off"):
        DataConfig(chat_template="off", chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs must be a mapping, got \['x'\]"):
        DataConfig(chat_template_kwargs=["x"])


def test_prompts_over_max_prompt_tokens_are_skipped_with_the_setting_named(tok, caplog):
    records = [("copy 12=", "12"), ("copy " + "7" * 10 + "=", ""), ("copy 3=", "3")]
    stream = PromptStream(records, tok, name="p", max_tokens=100, max_prompt_tokens=12)
    assert sorted(p.text for p in stream.prompts) == ["copy 12=", "copy 3="]
    assert "1 of 3 prompts of p are longer than 12 tokens (generator.max_prompt_tokens" in caplog.text
    assert "raise generator.max_prompt_tokens" in caplog.text
    # the model's context binds where it is lower; 0 is no limit of its own
    assert len(PromptStream(records, tok, name="p", max_tokens=10, max_prompt_tokens=12).prompts) == 2
    assert len(PromptStream(records, tok, max_prompt_tokens=0).prompts) == 3
    with pytest.raises(ValueError, match=r"3 of 3 prompts .* none is left; shorten the prompts or raise "
                                         r"generator.max_prompt_tokens"):
        PromptStream(records, tok, name="p", max_prompt_tokens=2)


def test_max_prompt_tokens_is_checked():
    from async_rlhf.config import GeneratorConfig

    with pytest.raises(ConfigError, match=r"generator.max_prompt_tokens must be >= 0 .*got -1"):
        GeneratorConfig(max_prompt_tokens=-1)
