"""`answer_judge`: the deterministic parser on a table of cases; the HTTP judge against a
local OpenAI-compatible server on 127.0.0.1 (verdicts, cache, retries, concurrency,
timeouts and malformed replies under both error policies, no row lost); the local judge
on a tiny random transformers causal LM."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from uniweave.config import ConfigError
from uniweave.config.schema import RewardConfig, RewardPluginConfig
from uniweave.core.sample import Sample, TextPart
from uniweave.rewards import RewardError, build_reward_service
from uniweave.rewards.judge import SYSTEM, judge_prompt, parse_verdict

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "reference, answer, expected",
    [
        ("B", "B", 1.0),
        ("B", "(b)", 1.0),
        ("B", "Answer: B.", 1.0),
        ("B", "B) seven", 1.0),
        ("B", "C", 0.0),
        ("B", "the second one", None),
        ("7", "7", 1.0),
        ("7", "It is 7.", 1.0),
        ("7", "7.0", 1.0),
        ("1,200", "1200", 1.0),
        ("3/4", "0.75", 1.0),
        ("7", "8", 0.0),
        ("7", "seven", None),
        ("7", "7 or 8", None),
        ("Paris", "  paris. ", 1.0),
        ("Paris", '"Paris"', 1.0),
        ("Paris", "The capital is Paris", None),
    ],
)
def test_parser_decides_what_it_can(reference, answer, expected):
    assert parse_verdict(reference, answer) == expected


# -- an OpenAI-compatible endpoint on 127.0.0.1 -------------------------------------------


class Endpoint:
    """A /v1/chat/completions server whose reply depends on the candidate answer:
    'seven'/'sept' -> "Yes.", 'eight' -> "no", 'slow' -> sleeps 1.2 s (past the client's
    0.5 s timeout), 'garbage' -> not JSON, 'maybe' -> a reply that is no verdict, 'flaky'
    -> HTTP 500 on its first request then "yes", 'wait*' -> "yes" after 0.2 s
    (concurrency probe), anything else -> "yes"."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/v1/chat/completions" and body["model"] == "judge-1"
                assert body["messages"][0] == {"role": "system", "content": SYSTEM}
                prompt = body["messages"][1]["content"]
                answer = prompt.split("Candidate answer: ")[1].split("\n")[0]
                with endpoint.lock:
                    endpoint.requests.append(answer)
                    endpoint.in_flight += 1
                    endpoint.max_in_flight = max(endpoint.max_in_flight, endpoint.in_flight)
                    first = endpoint.requests.count(answer) == 1
                try:  # the request's work; it leaves the in-flight count before its reply
                    # is sent, so a client thread freed by a reply cannot be counted
                    # beside a handler that has not yet reached this finally
                    if answer == "slow":
                        time.sleep(1.2)
                    if answer.startswith("wait"):
                        time.sleep(0.2)
                finally:
                    with endpoint.lock:
                        endpoint.in_flight -= 1
                self._reply(answer, first)

            def _reply(self, answer, first):
                if answer == "flaky" and first:
                    self.send_error(500)
                    return
                content = {"seven": "Yes.", "sept": "yes", "eight": "no", "maybe": "Perhaps"}
                text = content.get(answer, "yes")
                raw = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})
                if answer == "garbage":
                    raw = '{"choices": ['
                data = raw.encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out first

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    server = Endpoint()
    yield server
    server.close()


class Ended:
    """The three fields the reward service reads of a trajectory (ended eos)."""

    def __init__(self, sample_id):
        self.sample_id, self.finish_reason, self.length_semantics = sample_id, "eos", "cap"


def rows(answers, reference="7"):
    samples = [
        Sample(
            id=f"q{i}", task="i2t_open", parts=[TextPart("Which digit?", "user")], answer=reference
        )
        for i in range(len(answers))
    ]
    responses = [None if a is None else [TextPart(a, "assistant")] for a in answers]
    return samples, [Ended(s.id) for s in samples], responses


def http_reward(url, on_error="zero", **kwargs):
    kw = {"base_url": url, "model": "judge-1", "timeout": 0.5, "retries": 1, "concurrency": 4}
    plugin = RewardPluginConfig(name="answer_judge", kwargs={**kw, **kwargs})
    return build_reward_service(RewardConfig(plugins=[plugin], on_error=on_error))


def test_http_judge_scores_only_unresolved_rows_caches_and_retries(endpoint):
    service = http_reward(endpoint.url)
    answers = ["7", "8", "seven", "eight", "flaky", None, "seven"]
    result = service.score(*rows(answers))
    # parser: 7 -> 1, 8 -> 0; judge: seven -> yes, eight -> no, flaky -> 500 then yes;
    # unparsable row -> invalid 0; the repeated "seven" is asked once
    assert result.total.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert result.invalid["answer_judge"].tolist() == [False] * 5 + [True, False]
    assert sorted(endpoint.requests) == ["eight", "flaky", "flaky", "seven"]
    m = result.metrics()
    assert m["reward/answer_judge/n_rows"] == 7 and m["reward/answer_judge/n_judged"] == 4
    assert m["reward/answer_judge/judged_frac"] == 4 / 7
    assert m["reward/answer_judge/parsed_frac"] == 3 / 7
    assert m["reward/n_errors"] == 0
    again = service.score(*rows(["seven", "eight"]))
    assert again.total.tolist() == [1.0, 0.0] and len(endpoint.requests) == 4  # cached
    assert again.metrics()["reward/answer_judge/cached_frac"] == 1.0


def test_http_judge_failures_follow_the_error_policy(endpoint):
    answers = ["7", "slow", "garbage", "maybe", "sept", "8"]
    result = http_reward(endpoint.url).score(*rows(answers))
    assert len(result.total) == len(answers)  # no row lost
    assert result.total.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert result.errors["answer_judge"].tolist() == [False, True, True, True, False, False]
    m = result.metrics()
    assert m["reward/n_errors"] == 3 and m["reward/answer_judge/n_judge_failed"] == 3
    # each failing answer was tried 1 + retries times; a failure is never cached
    assert {a: endpoint.requests.count(a) for a in ("slow", "garbage", "maybe")} == dict.fromkeys(
        ("slow", "garbage", "maybe"), 2
    )
    with pytest.raises(RewardError, match=r"'answer_judge' failed on sample 'q1'.*3 of 6") as err:
        http_reward(endpoint.url, on_error="raise").score(*rows(answers))
    assert err.value.sample_ids == ["q1", "q2", "q3"]


def test_http_judge_runs_concurrency_requests_at_once(endpoint):
    answers = [f"wait{c}" for c in "abcdef"]
    result = http_reward(endpoint.url, concurrency=3, timeout=5.0).score(*rows(answers))
    assert result.total.tolist() == [1.0] * 6
    assert endpoint.max_in_flight == 3  # each reply takes 0.2 s: the pool's 3 threads overlap
    assert sorted(endpoint.requests) == answers


def test_judge_config_errors_name_the_key():
    def build(**plugin):
        return build_reward_service(
            RewardConfig(plugins=[RewardPluginConfig(name="answer_judge", **plugin)])
        )

    with pytest.raises(
        ConfigError,
        match=r"reward\.plugins\.0\.kwargs\.base_url: answer_judge needs exactly one judge",
    ):
        build()
    with pytest.raises(
        ConfigError, match=r"reward\.plugins\.0\.kwargs\.device: applies only to a path judge"
    ):
        build(kwargs={"base_url": "http://127.0.0.1:9/v1", "model": "m", "device": "cpu"})
    with pytest.raises(ConfigError, match=r"reward\.plugins\.0\.kwargs: timeout must be > 0"):
        build(kwargs={"base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout": 0})
    with pytest.raises(ConfigError, match=r"reward\.plugins\.0\.kwargs: model: missing"):
        build(kwargs={"base_url": "http://127.0.0.1:9/v1"})


# -- a tiny local causal LM ----------------------------------------------------------------

WORDS = ["<unk>", "<pad>", "yes", "no", "question", "answer", "seven", "eight", "7", "digit"]


def write_tiny_lm(path: Path, seed: int = 0) -> Path:
    """A random 1-layer Llama with a WordLevel tokenizer (no chat template), saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=1.0,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_local_judge_verdict_is_the_yes_no_logit_comparison(tmp_path):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    path = write_tiny_lm(tmp_path / "lm")
    plugin = RewardPluginConfig(name="answer_judge", path=str(path))
    service = build_reward_service(RewardConfig(plugins=[plugin]))
    answers = ["7", "seven", "eight", "seven digit", "question answer", "8"]
    result = service.score(*rows(answers))
    # independently: the raw tokenizer and the model's forward, logit[yes] > logit[no]
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(path).eval()
    expected = []
    for a in answers[1:5]:
        text = f"{SYSTEM}\n{judge_prompt('Which digit?', '7', a)}\nAnswer:"
        with torch.no_grad():
            last = model(input_ids=torch.tensor([raw.encode(text).ids])).logits[0, -1]
        expected.append(float(last[2] > last[3]))  # ids of "yes", "no"
    assert result.total.tolist() == [1.0, *expected, 0.0]
    assert result.metrics()["reward/answer_judge/judged_frac"] == 4 / 6
    # the same judge with the "yes" and "no" rows of its output layer swapped flips them
    with torch.no_grad():
        model.lm_head.weight[[2, 3]] = model.lm_head.weight[[3, 2]].clone()
    model.save_pretrained(tmp_path / "swapped")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "swapped" / f).write_text((path / f).read_text())
    swapped = build_reward_service(
        RewardConfig(
            plugins=[RewardPluginConfig(name="answer_judge", path=str(tmp_path / "swapped"))]
        )
    ).score(*rows(answers))
    assert swapped.total.tolist()[1:5] == [1.0 - v for v in expected]  # (no ties)


def test_a_grpo_run_trains_on_the_http_judge(endpoint, tmp_path, monkeypatch, small_vq_dir):
    """`uniweave train` (in process) of a recipe-like config whose reward is answer_judge on
    the local endpoint: an update with every row scored, the judged share logged, and
    every judge request one the parser left unresolved."""
    import yaml

    from uniweave.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "grpo_tiny.yaml"
    judge = {"base_url": endpoint.url, "model": "judge-1", "timeout": 5.0, "retries": 1}
    config = {
        "defaults": str(recipe),
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {
            "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
            "codec": {"path": str(small_vq_dir), "codebook_size": 16},
        },
        "data": {"tasks": ["i2t_open"], "train_size": 16, "val_size": 0, "test_size": 0},
        "rollout": {"max_new_tokens": 6},
        "reward": {"plugins": [{"name": "answer_judge", "kwargs": judge}]},
        "trainer": {
            "total_updates": 1,
            "global_batch_size": 16,
            "micro_batch_size": 16,
            "scheduler": {"warmup_steps": 0},
        },
        "checkpoint": {"every_updates": 0},
        "logging": {"tensorboard": False, "progress_bar": False, "every": 1},
    }
    path = tmp_path / "judge.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")
    assert main(["train", str(path)]) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    updates = [m for m in map(json.loads, lines) if "reward/answer_judge/n_rows" in m]
    assert [m["reward/answer_judge/n_rows"] for m in updates] == [16.0]
    for m in updates:
        assert m["reward/answer_judge/judged_frac"] + m["reward/answer_judge/parsed_frac"] == 1.0
        assert m["reward/n_errors"] == 0.0
    fresh = sum(
        m["reward/answer_judge/n_judged"] - m["reward/answer_judge/n_cached"] for m in updates
    )
    assert 0 < len(endpoint.requests) <= fresh  # identical rows of one batch share a request
    # every reference is a digit: what the parser leaves to the judge (no single number)
    # does not depend on which digit
    assert all(parse_verdict("7", a) is None for a in endpoint.requests)
