"""`answer_judge`: a verifier that parses first and asks a judge only when parsing cannot
decide.

For a row with question q (`meta["question"]` when set, else the sample's non-assistant
text parts joined by " "), reference r (`Sample.answer`) and response a (its text):

1. Format: a row that could not be parsed, or whose text is empty, is invalid (0, never
   judged).
2. Deterministic parser (`parse_verdict`), on normalised text (lower case, whitespace
   collapsed, a leading "answer:" / "the answer is" and trailing ". ! ;" dropped, one
   pair of enclosing quotes or brackets removed):
   - letters: r is one letter A-Z -> a must name one letter ("B", "(b)", "B.", "B) 7",
     "answer: b"): 1 if it is r, else 0; a naming no single letter is unresolved;
   - numbers: r is a number ("1,200", "-3.5", "3/4") -> a holding exactly one number:
     1 if equal (relative tolerance 1e-9), else 0; none or several numbers: unresolved;
   - text: normalised a == normalised r -> 1; anything else is unresolved (a paraphrase
     may still be right).
3. Judge, for the unresolved rows only, asked "is the candidate answer correct?":
   - an OpenAI-compatible HTTP endpoint (kwargs `base_url`, `model`): POST
     `<base_url>/chat/completions` (temperature 0), the verdict is the first word of
     `choices[0].message.content`: yes / correct / true -> 1, no / incorrect / false ->
     0, anything else is a malformed reply. `timeout` seconds per request, `retries`
     more tries after a timeout, connection error, HTTP error or malformed reply,
     `concurrency` requests in flight (threads); the key, if any, is read from the
     environment variable `api_key_env` (never from the config). Standard library only.
   - a local transformers causal LM (`path`, never remote code; kwarg `device`): the
     verdict is 1 when the next-token logit of "yes" exceeds that of "no" after the
     judge prompt (greedy and always well-formed; one forward per row, no sampling).
   A verdict is cached by sha256 of (q, r, a): a repeated row is judged once per
   process. A row whose judge fails after its retries scores NaN, which the reward
   service treats as a plugin failure of that row (`reward.on_error`: raise names it,
   zero scores it 0 and counts it); failures are not cached.

Counts (`pop_counts`, logged as `reward/answer_judge/<name>` and `<x>_frac` of n_rows):
n_rows, n_parsed (decided by the parser), n_judged (decided by a judge call, cached or
not), n_cached (of those, from the cache), n_judge_failed.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from uniweave.config.errors import ConfigError
from uniweave.config.schema import RewardPluginConfig
from uniweave.core.sample import Sample, TextPart
from uniweave.rewards.base import Response, RewardPlugin, local_model_dir

logger = logging.getLogger(__name__)

HTTP_KWARGS = ("base_url", "model", "timeout", "retries", "concurrency", "api_key_env")
LOCAL_KWARGS = ("device",)
YES = frozenset({"yes", "correct", "true"})
NO = frozenset({"no", "incorrect", "false"})
SYSTEM = (
    "You grade answers. Given a question, a reference answer and a candidate answer, "
    "reply with one word: yes if the candidate answer means the same as the reference, "
    "no otherwise."
)
_PREFIX = re.compile(r"^(?:final answer|the answer is|answer)\s*[:\-]?\s*")
_LETTER = re.compile(r"^\(?([a-z])\)?(?:[.):]|\s|$)")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_PAIRS = {'"': '"', "'": "'", "(": ")", "[": "]", "`": "`"}


class JudgeError(RuntimeError):
    """A judge call failed (after its retries): timeout, HTTP error or malformed reply."""


def normalise(text: str) -> str:
    """Lower case, whitespace collapsed, answer prefixes, trailing .!; and one pair of
    enclosing quotes/brackets removed."""
    text = " ".join(text.lower().split())
    text = _PREFIX.sub("", text).rstrip(".!; ").strip()
    if len(text) >= 2 and _PAIRS.get(text[0]) == text[-1]:
        text = text[1:-1].strip()
    return text


def _number(text: str) -> Fraction | None:
    if not _NUMBER.fullmatch(text):
        return None
    num, _, den = text.replace(",", "").partition("/")
    try:
        value = Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def parse_verdict(reference: str, answer: str) -> float | None:
    """1.0 / 0.0 when the parser decides, None when a judge must (module docstring)."""
    ref, ans = normalise(reference), normalise(answer)
    if not ans:
        return 0.0
    if len(ref) == 1 and ref.isalpha():
        match = _LETTER.match(ans)
        return None if match is None else float(match.group(1) == ref)
    ref_number = _number(ref)
    if ref_number is not None:
        found = _NUMBER.findall(ans)
        if len(found) != 1:
            return None
        value = _number(found[0])
        if value is None:
            return None
        scale = max(abs(float(ref_number)), 1e-300)
        return float(abs(float(value - ref_number)) <= 1e-9 * scale)
    return 1.0 if ans == ref else None


def question_text(sample: Sample) -> str:
    """meta["question"], else the non-assistant text parts joined by " "."""
    question = sample.meta.get("question")
    if isinstance(question, str) and question.strip():
        return question.strip()
    texts = [p.text for p in sample.parts if isinstance(p, TextPart) and p.role != "assistant"]
    return " ".join(t.strip() for t in texts if t.strip())


def judge_prompt(question: str, reference: str, answer: str) -> str:
    return (
        f"Question: {question}\nReference answer: {reference}\nCandidate answer: {answer}\n"
        "Is the candidate answer correct? Reply yes or no."
    )


def reply_verdict(content: object) -> float:
    """1.0 / 0.0 from a judge's reply text; JudgeError when it is neither."""
    if not isinstance(content, str):
        raise JudgeError(f"malformed reply: content is {type(content).__name__}, not text")
    words = re.findall(r"[a-z]+", content.lower())
    first = words[0] if words else ""
    if first in YES:
        return 1.0
    if first in NO:
        return 0.0
    raise JudgeError(f"malformed reply: {content[:60]!r} is not yes or no")


def cache_key(question: str, reference: str, answer: str) -> str:
    return hashlib.sha256(json.dumps([question, reference, answer]).encode()).hexdigest()


class HttpJudge:
    """An OpenAI-compatible /chat/completions endpoint (module docstring)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout: float = 30.0,
        retries: int = 2,
        concurrency: int = 4,
        api_key_env: str | None = None,
    ) -> None:
        if not re.match(r"^https?://", base_url):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        for name, value, low in (("retries", retries, 0), ("concurrency", concurrency, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must name the endpoint's model")
        self.api_key = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise ValueError(f"api_key_env: environment variable {api_key_env} is not set")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.timeout = model, float(timeout)
        self.retries, self.concurrency = retries, concurrency

    def _once(self, prompt: str) -> float:
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": prompt},
            ],
            "temperature": 0,
            "max_tokens": 4,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            raise JudgeError(f"HTTP {err.code} from {self.url}") from err
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", err)
            raise JudgeError(f"{self.url}: {type(reason).__name__}: {reason}") from err
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise JudgeError(f"malformed reply from {self.url}: {raw[:60]!r}") from err
        return reply_verdict(content)

    def verdict(self, prompt: str) -> float:
        """The verdict of one prompt, retried; JudgeError after the last try."""
        for attempt in range(self.retries + 1):
            try:
                return self._once(prompt)
            except JudgeError as err:
                if attempt == self.retries:
                    raise JudgeError(f"{err} (after {self.retries + 1} tries)") from err
        raise AssertionError("unreachable")

    def verdicts(self, prompts: Sequence[str]) -> list[float | JudgeError]:
        """Each prompt's verdict, or its JudgeError, `concurrency` requests at a time."""

        def one(prompt: str) -> float | JudgeError:
            try:
                return self.verdict(prompt)
            except JudgeError as err:
                return err

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(one, prompts))


class LocalJudge:
    """A local transformers causal LM: yes when logit("yes") > logit("no") (docstring)."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        path = Path(path)
        self.device = local_model_dir(path, device, "answer_judge")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForCausalLM.from_pretrained(str(path)).to(self.device).eval()  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound
        self.model.requires_grad_(False)
        self.yes, self.no = (self._word_id(w) for w in ("yes", "no"))
        if self.yes == self.no:
            raise ValueError(f"{path}: the tokenizer gives 'yes' and 'no' the same first token")
        self.lock = threading.Lock()

    def _word_id(self, word: str) -> int:
        ids = self.tokenizer.encode(" " + word, add_special_tokens=False) or self.tokenizer.encode(
            word, add_special_tokens=False
        )
        if not ids or ids[0] == self.tokenizer.unk_token_id:
            raise ValueError(f"the judge's tokenizer has no token for {word!r}")
        return int(ids[0])

    def input_ids(self, prompt: str) -> torch.Tensor:
        """The judge's input: the chat template (system + user, generation prompt) when the
        tokenizer has one, else the plain text `SYSTEM + prompt + " Answer:"`."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = self.tokenizer.encode(f"{SYSTEM}\n{prompt}\nAnswer:")
        return torch.tensor([list(ids)], dtype=torch.long)

    @torch.no_grad()
    def verdicts(self, prompts: Sequence[str]) -> list[float | JudgeError]:
        out: list[float | JudgeError] = []
        with self.lock:
            for prompt in prompts:
                try:
                    ids = self.input_ids(prompt).to(self.device)
                    last = self.model(input_ids=ids).logits[0, -1].float()
                except (RuntimeError, IndexError, ValueError) as err:  # e.g. past its context
                    out.append(JudgeError(f"local judge: {type(err).__name__}: {err}"))
                    continue
                out.append(float(last[self.yes] > last[self.no]))
        return out


class AnswerJudge(RewardPlugin):
    """Parse first, judge the unresolved rows (module docstring)."""

    name = "answer_judge"
    requires_answer = True
    config_kwargs = frozenset(HTTP_KWARGS + LOCAL_KWARGS)

    def __init__(self, judge: HttpJudge | LocalJudge) -> None:
        self.judge = judge
        self.cache: dict[str, float] = {}
        self.counts = dict.fromkeys(
            ("n_rows", "n_parsed", "n_judged", "n_cached", "n_judge_failed"), 0.0
        )

    @classmethod
    def from_config(
        cls, cfg: RewardPluginConfig, key: str, resources: Mapping[str, Any] | None = None
    ) -> AnswerJudge:
        """Build from `reward.plugins.N`: exactly one of `path` (a local causal LM) and
        kwargs.base_url (an HTTP endpoint, with kwargs.model)."""
        kw: dict[str, Any] = dict(cfg.kwargs)  # user values: the constructor checks them
        if (cfg.path is None) == ("base_url" not in kw):
            raise ConfigError(
                "answer_judge needs exactly one judge",
                key=f"{key}.path" if cfg.path is not None else f"{key}.kwargs.base_url",
                expected="path (a local transformers causal LM) or kwargs.base_url + "
                "kwargs.model (an OpenAI-compatible endpoint), not both",
            )
        allowed = LOCAL_KWARGS if cfg.path else HTTP_KWARGS
        for name in kw:
            if name not in allowed:
                raise ConfigError(
                    f"applies only to a {'base_url' if name in HTTP_KWARGS else 'path'} judge",
                    key=f"{key}.kwargs.{name}",
                    expected=" | ".join(allowed),
                )
        try:
            if cfg.path is not None:
                return cls(LocalJudge(cfg.path, **kw))
            if "model" not in kw:
                raise ValueError("model: missing (the endpoint's model name)")
            return cls(HttpJudge(**kw))
        except FileNotFoundError as err:
            raise ConfigError(str(err), key=f"{key}.path") from err
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err), key=f"{key}.kwargs") from err

    @staticmethod
    def _answer(response: Response) -> str | None:
        if not response.parsed:
            return None
        return response.text.strip() or None

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [self._answer(r) is None for r in responses]

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        out = [0.0] * len(samples)
        pending: dict[str, tuple[str, list[int]]] = {}
        self.counts["n_rows"] += len(samples)
        for i, (sample, response) in enumerate(zip(samples, responses)):
            if sample.answer is None:
                raise ValueError(f"sample {sample.id!r} has no answer")
            answer = self._answer(response)
            if answer is None:
                self.counts["n_parsed"] += 1
                continue
            parsed = parse_verdict(sample.answer, answer)
            if parsed is not None:
                out[i] = parsed
                self.counts["n_parsed"] += 1
                continue
            question, reference = question_text(sample), sample.answer.strip()
            digest = cache_key(question, reference, answer)
            self.counts["n_judged"] += 1
            if digest in self.cache:
                out[i] = self.cache[digest]
                self.counts["n_cached"] += 1
                continue
            pending.setdefault(digest, (judge_prompt(question, reference, answer), []))[1].append(i)
        digests = list(pending)
        results = self.judge.verdicts([pending[d][0] for d in digests]) if digests else []
        for digest, result in zip(digests, results):
            rows = pending[digest][1]
            if isinstance(result, JudgeError):
                self.counts["n_judge_failed"] += len(rows)
                logger.warning("answer_judge: %s (sample %s)", result, samples[rows[0]].id)
                for i in rows:
                    out[i] = math.nan
                continue
            self.cache[digest] = result
            for i in rows:
                out[i] = result
        return out

    def pop_counts(self) -> dict[str, float]:
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return counts
