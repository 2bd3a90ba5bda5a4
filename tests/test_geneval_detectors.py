"""GenEval's detectors, colour classifier, `uniweave score` and the `geneval` reward.

The transformers paths run end to end on tiny random Mask2Former, OWLv2 and CLIP models
built and saved here (no download). The reward plugin and the folder scoring are tested
on a small deterministic detector defined here (`TableDetector`: detections looked up
from a table by the image's grey level), which implements the `Detector` interface: the
things under test are the plugin and the scoring, not a detector.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import write_tiny_clip, write_tiny_mask2former
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    CLIPModel,
    CLIPProcessor,
    Owlv2Config,
    Owlv2ForObjectDetection,
    Owlv2ImageProcessorPil,
    Owlv2Processor,
    PreTrainedTokenizerFast,
)

from uniweave.cli import main
from uniweave.config import ConfigError, RewardConfig, RewardPluginConfig
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.core.trajectory import Trajectory
from uniweave.eval.geneval import COCO_CLASSES, Detection, judge, parse_row
from uniweave.rewards import RewardError, RewardService, build_plugin, build_reward_service
from uniweave.rewards.geneval.colour import BACKGROUND, ClipColourClassifier, colour_crop
from uniweave.rewards.geneval.detectors import (
    DetectionError,
    Detector,
    Mask2FormerDetector,
    Owlv2Detector,
    load_detector,
)
from uniweave.rewards.geneval.reward import GenEvalReward
from uniweave.rewards.service import PluginSpec

pytestmark = pytest.mark.usefixtures("one_thread")

OWL_CLASSES = ("cat", "dog", "car")
CLIP_WORDS = [
    "<|startoftext|>", "<|endoftext|>", "<unk>", "a", "photo", "of", "-", "colored",
    "object", "cat", "dog", "red", "orange", "yellow", "green", "blue", "purple", "pink",
    "brown", "black", "white",
]  # fmt: skip


# ------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module")
def m2f_dir(tmp_path_factory) -> Path:
    return write_tiny_mask2former(tmp_path_factory.mktemp("m2f"))


def _word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """WordLevel tokenizer; id 0 is <unk> (OWL masks queries whose first id is 0)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{words[1]} $A {words[2]}", special_tokens=[(words[1], 1), (words[2], 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=words[1], eos_token=words[2], pad_token=words[2],
        unk_token="<unk>", model_max_length=16,
    )  # fmt: skip


@pytest.fixture(scope="module")
def owl_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("owl")
    words = ["<unk>", "<|startoftext|>", "<|endoftext|>", *OWL_CLASSES]
    text = {
        "vocab_size": len(words), "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }  # fmt: skip
    vision = {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
    }  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Owlv2ForObjectDetection(
            Owlv2Config(text_config=text, vision_config=vision, projection_dim=16)
        )
    model.save_pretrained(str(path))
    processor = Owlv2Processor(
        image_processor=Owlv2ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=_word_tokenizer(words),
    )
    processor.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    return write_tiny_clip(tmp_path_factory.mktemp("clip"), CLIP_WORDS)


def _random_images(n: int, size: tuple[int, int] = (40, 48), seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    h, w = size
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


# ------------------------------------------------------------------ transformers detectors


def test_mask2former_boxes_come_from_masks_and_flow_into_judge(m2f_dir):
    detector = Mask2FormerDetector(m2f_dir, device="cpu", batch_size=2)
    assert detector.classes == ("cat", "dog", "computer mouse")
    images = _random_images(3)
    found = detector.detect(images)
    assert len(found) == 3 and all(found)
    for image, dets in zip(images, found):
        for det in dets:
            assert det.mask.shape == (image.height, image.width) and det.mask.dtype == bool
            ys, xs = np.nonzero(det.mask)  # the tight box of the mask, pixel edges
            assert det.box == (xs.min(), ys.min(), xs.max() + 1.0, ys.max() + 1.0)
    cats = [d for d in found[0] if d.label == "cat"]
    assert any(d.score > 0.3 for d in cats), [d.score for d in cats]  # the biased class head
    row = parse_row({"tag": "single_object", "prompt": "a cat",
                     "include": [{"class": "cat", "count": 1}]}, "t:1")  # fmt: skip
    verdict = judge(row, found[0], images[0].size)
    kept = sorted((d for d in cats if d.score > 0.3), key=lambda d: -d.score)[:16]
    assert verdict.correct
    assert [d.box for d in verdict.detected["cat"]] == [d.box for d in kept]


def _same_detections(a: list[Detection], b: list[Detection], score_bound: float) -> None:
    assert [d.label for d in a] == [d.label for d in b]
    assert [d.box for d in a] == [d.box for d in b]
    for x, y in zip(a, b):
        assert abs(x.score - y.score) <= score_bound, (x.score, y.score)
        if x.mask is not None:
            assert np.array_equal(x.mask, y.mask)


# Batched and one-by-one runs see the same pixels (every image is resized to the same
# square, so no padding differs); only the order of float32 sums in batched matmuls may
# differ, by a few ulps of values near 1. Mask2Former's scores are rounded to 6 decimals by
# transformers, so such a difference moves a score by at most one unit of the 6th decimal:
# bound 1e-6. OWLv2's sigmoid scores are not rounded: |d sigmoid| <= |d logit| / 4, and a
# logit of this tiny model (|logit| < 100) moves by at most a few float32 ulps (2^-23 x 128
# each): 1e-5 bounds it with room. Boxes and masks must be equal (a flip would need a
# logit within those ulps of 0; this seed has none, checked by equality).
M2F_SCORE_BOUND = 1e-6
OWL_SCORE_BOUND = 1e-5


def test_mask2former_batches_give_the_detections_of_one_by_one(m2f_dir):
    images = _random_images(3, seed=1)
    batched = Mask2FormerDetector(m2f_dir, batch_size=3).detect(images)
    single = Mask2FormerDetector(m2f_dir, batch_size=1)
    for image, dets in zip(images, batched):
        _same_detections(dets, single.detect([image])[0], M2F_SCORE_BOUND)


def test_owlv2_detects_the_class_names_and_batches_like_one_by_one(owl_dir):
    detector = Owlv2Detector(owl_dir, batch_size=2, classes=OWL_CLASSES)
    images = _random_images(3, size=(30, 40), seed=2)
    batched = detector.detect(images)
    assert all(batched)
    for image, dets in zip(images, batched):
        for det in dets:
            assert det.label in OWL_CLASSES and det.mask is None
            x1, y1, x2, y2 = det.box  # clipped to the image, with area
            assert 0 <= x1 < x2 <= image.width and 0 <= y1 < y2 <= image.height
        _same_detections(dets, detector.detect([image])[0], OWL_SCORE_BOUND)
    floor = sorted(d.score for d in batched[0])[len(batched[0]) // 2]
    kept = detector.detect(images[:1], min_score=floor)[0]
    assert kept and all(d.score >= floor for d in kept)
    assert len(kept) == sum(d.score >= floor for d in batched[0])


def test_arrays_are_read_as_the_png_they_would_be_saved_as(m2f_dir):
    detector = Mask2FormerDetector(m2f_dir)
    image = _random_images(1, seed=3)[0]
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    as_pil = detector.detect([image])[0]
    for other in (pixels, torch.from_numpy(pixels).permute(2, 0, 1)):
        _same_detections(detector.detect([other])[0], as_pil, 0.0)
    with pytest.raises(ValueError, match=r"image of shape \[2, 3, 4, 5\]"):
        detector.detect([np.zeros((2, 3, 4, 5))])


def test_device_is_honoured_and_checked(m2f_dir, owl_dir):
    detector = load_detector("mask2former", m2f_dir, device="cpu")
    assert detector.device == torch.device("cpu")
    assert {p.device for p in detector.model.parameters()} == {torch.device("cpu")}
    with pytest.raises(ValueError, match="device must be cpu or cuda, got 'tpu'"):
        load_detector("owlv2", owl_dir, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_detector("mask2former", m2f_dir, device="cuda")
    with pytest.raises(ValueError, match="unknown detector 'yolo'"):
        load_detector("yolo", m2f_dir)
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_detector("mask2former", m2f_dir.parent)


class _Broken(torch.nn.Module):
    """A model that fails on every forward pass (a detector whose model breaks)."""

    def forward(self, **kwargs):
        raise RuntimeError("out of memory")


def test_a_failing_model_is_a_detection_error_naming_the_images(m2f_dir):
    detector = Mask2FormerDetector(m2f_dir, batch_size=2)
    detector.model = _Broken()
    with pytest.raises(DetectionError, match=r"mask2former detector failed on images 0\.\.1: "
                       r"RuntimeError: out of memory"):  # fmt: skip
        detector.detect(_random_images(3))


# ------------------------------------------------------------------ colour


def test_colour_crop_masks_with_grey_and_cuts_the_box():
    pixels = np.arange(6 * 5 * 3, dtype=np.uint8).reshape(6, 5, 3)
    mask = np.zeros((6, 5), dtype=bool)
    mask[2:4, 1:3] = True
    mask[3, 3] = True
    det = Detection("cat", 0.9, (1, 2, 4, 4), mask)
    crop = np.asarray(colour_crop(Image.fromarray(pixels), det))
    expected = np.where(mask[:, :, None], pixels, np.array(BACKGROUND, dtype=np.uint8))[2:4, 1:4]
    assert np.array_equal(crop, expected)
    unmasked = Detection("cat", 0.9, (0.4, 0.6, 2.5, 3.4))  # PIL rounds: (0, 1, 2, 3)
    assert np.array_equal(np.asarray(colour_crop(Image.fromarray(pixels), unmasked)),
                          pixels[1:3, 0:2])  # fmt: skip


# The classifier's vectors against the same sums done here from CLIPModel's text features
# one prompt at a time: each side normalises, averages 3 and normalises 16-wide vectors in
# float32, so elements agree within a few ulps of 1 (1e-6). A padded batch of prompts
# against single prompts can move the text features by the attention's float32 sums (a few
# ulps of values below 10), so 1e-5 bounds the whole.
COLOUR_BOUND = 1e-5


def test_colour_classifier_is_geneval_zero_shot(clip_dir):
    classifier = ClipColourClassifier(clip_dir, batch_size=2)
    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    processor = CLIPProcessor.from_pretrained(str(clip_dir))
    colours = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown",
               "black", "white"]  # fmt: skip
    prompts = ["a photo of a {} cat", "a photo of a {}-colored cat", "a photo of a {} object"]
    rows = []
    with torch.no_grad():
        for colour in colours:
            feats = []
            for prompt in prompts:
                tokens = processor.tokenizer([prompt.format(colour)], return_tensors="pt")
                f = model.get_text_features(**tokens).pooler_output[0]
                feats.append(f / f.norm())
            mean = torch.stack(feats).mean(0)
            rows.append(mean / mean.norm())
    weights = torch.stack(rows)
    assert (classifier.weights("cat") - weights).abs().max() <= COLOUR_BOUND
    crops = _random_images(5, size=(12, 9), seed=4)
    with torch.no_grad():
        img = model.get_image_features(**processor.image_processor(crops, return_tensors="pt"))
        img = torch.nn.functional.normalize(img.pooler_output, dim=-1)
    logits = img @ weights.T
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 2 * COLOUR_BOUND).all()  # no near-tie to flip
    assert classifier.classify(crops, "cat") == [colours[k] for k in logits.argmax(-1)]


# ------------------------------------------------------------------ a deterministic detector


class TableDetector(Detector):
    """Detections looked up by an image's grey level (its top-left pixel's red value):
    `table[level]`. Records the size of every batch it is given."""

    name = "table"

    def __init__(self, table: dict[int, list[Detection]], batch_size: int = 8) -> None:
        self.table = table
        self.classes = COCO_CLASSES
        self.device = torch.device("cpu")
        self.batch_size = batch_size
        self.batches: list[int] = []

    def detect_batch(self, images, min_score):
        self.batches.append(len(images))
        out = []
        for image in images:
            level = image.getpixel((0, 0))[0]
            if level not in self.table:
                raise KeyError(f"no detections for grey level {level}")
            out.append([d for d in self.table[level] if d.score >= min_score])
        return out


def grey(level: int, size: tuple[int, int] = (32, 32)) -> np.ndarray:
    """A [H, W, 3] float image of one grey level (what a decoded response holds)."""
    return np.full((*size, 3), level / 255.0, dtype=np.float32)


def det(label: str, score: float, box=(2, 2, 10, 10), colour=None) -> Detection:
    return Detection(label, score, box, colour=colour)


ROWS = {
    "cat": {"tag": "single_object", "prompt": "a photo of a cat",
            "include": [{"class": "cat", "count": 1}]},
    "cat_dog": {"tag": "two_object", "prompt": "a photo of a cat and a dog",
                "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]},
    "two_cats": {"tag": "counting", "prompt": "a photo of two cats",
                 "include": [{"class": "cat", "count": 2}],
                 "exclude": [{"class": "cat", "count": 3}]},
    "red_cat": {"tag": "colors", "prompt": "a photo of a red cat",
                "include": [{"class": "cat", "count": 1, "color": "red"}]},
}  # fmt: skip

TABLE = {
    10: [det("cat", 0.5)],  # a cat at 0.5: counts at threshold 0.3, not at 0.6
    20: [det("cat", 0.95)],  # a confident cat, no dog
    30: [det("cat", 0.95), det("cat", 0.92, (20, 2, 30, 10)), det("cat", 0.91, (2, 20, 9, 30))],
    40: [det("cat", 0.95), det("dog", 0.8, (15, 15, 30, 30))],
}


def sample(i: int, row: str) -> Sample:
    return Sample(f"s{i}", [TextPart(ROWS[row]["prompt"], "user")], task="t2i",
                  meta={"geneval": ROWS[row]})  # fmt: skip


def response(level: int) -> list:
    return [ImagePart(pixels=grey(level), role="assistant")]


def traj(sample_id: str) -> Trajectory:
    return Trajectory(
        token_ids=torch.tensor([3, 4]), modality=torch.zeros(2, dtype=torch.long),
        owner=torch.tensor([0, 1]), visual_codes=torch.full((2,), -1), image_grids=[],
        sample_id=sample_id, finish_reason="eos", length_semantics="cap",
    )  # fmt: skip


def score(plugin: GenEvalReward, cases: list[tuple[str, int | None]], on_error="raise"):
    samples = [sample(i, row) for i, (row, _) in enumerate(cases)]
    responses = [response(level) if level is not None else [TextPart("no", "assistant")]
                 for _, level in cases]  # fmt: skip
    service = RewardService([PluginSpec(plugin)], on_error=on_error, decode_images=lambda c: c)
    return service.score(samples, [traj(s.id) for s in samples], responses)


def plugin(threshold=None, partial=None, batch_size=None, detector=None) -> GenEvalReward:
    kwargs = {k: v for k, v in (("threshold", threshold), ("partial", partial),
                                ("batch_size", batch_size)) if v is not None}  # fmt: skip
    cfg = RewardPluginConfig(name="geneval", kwargs=kwargs)
    return build_plugin(cfg, resources={"geneval_detector": detector or TableDetector(TABLE)})


# ------------------------------------------------------------------ the reward plugin


def test_reward_is_geneval_correct_and_threshold_acts():
    cases = [("cat", 10), ("cat", 20), ("cat_dog", 20), ("cat_dog", 40), ("cat", None)]
    strict = score(plugin(), cases)
    # 0.5 > 0.3: a cat; no dog at level 20; cat and dog at 40; no image: invalid, 0
    assert strict.total.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert strict.invalid["geneval"].tolist() == [False] * 4 + [True]
    trained = score(plugin(threshold=0.6), cases)  # Flow-GRPO's training threshold
    assert trained.total.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_partial_credit_is_the_share_of_include_clauses_and_zero_on_a_failed_exclude():
    cases = [("cat_dog", 20), ("cat_dog", 40), ("two_cats", 20), ("two_cats", 30)]
    assert score(plugin(), cases).total.tolist() == [0.0, 1.0, 0.0, 0.0]
    # cat without dog: 1 of 2 clauses; two cats asked, one seen: 0 of 1; three seen: the
    # exclude clause (cat < 3) fails, so 0 although the include holds
    assert score(plugin(partial=True), cases).total.tolist() == [0.5, 1.0, 0.0, 0.0]


def test_per_tag_means_are_logged():
    result = score(plugin(partial=True), [("cat", 10), ("cat", 20), ("cat_dog", 20),
                                          ("cat_dog", 40), ("cat_dog", None)])  # fmt: skip
    m = result.metrics()
    assert m["reward/geneval/single_object_mean"] == 1.0
    assert m["reward/geneval/two_object_mean"] == pytest.approx((0.5 + 1.0 + 0.0) / 3, abs=0)
    assert m["reward/geneval/two_object_frac"] == 3 / 5
    assert m["reward/geneval/n_rows"] == 5


def test_batch_size_acts_on_the_detector_calls():
    table = TableDetector(TABLE)
    score(plugin(batch_size=2, detector=table), [("cat", 10)] * 5)
    assert table.batches == [2, 2, 1]


def test_errors_follow_the_reward_services_policy():
    cases = [("cat", 10), ("cat", 99), ("red_cat", 20)]  # 99: detector fails; colour: no CLIP
    with pytest.raises(RewardError, match="reward plugin 'geneval' failed on sample 's1'.*"
                       "grey level 99.*2 of 3 samples failed"):  # fmt: skip
        score(plugin(), cases)
    result = score(plugin(), cases, on_error="zero")
    assert result.errors["geneval"].tolist() == [False, True, True]
    assert result.total.tolist() == [1.0, 0.0, 0.0]
    bad = Sample("s9", [TextPart("x", "user")], meta={"geneval": {**ROWS["cat"], "tag": "x"}})
    service = RewardService([PluginSpec(plugin())], decode_images=lambda c: c)
    with pytest.raises(RewardError, match=r"sample 's9' meta\['geneval'\]: tag: expected one of"):
        service.score([bad], [traj("s9")], [response(10)])


def test_colour_rows_are_judged_with_clip(clip_dir):
    colours = ClipColourClassifier(clip_dir)
    crop = colour_crop(Image.fromarray((grey(20) * 255).astype(np.uint8)), TABLE[20][0])
    seen = colours.classify([crop], "cat")[0]
    other = next(c for c in ("red", "blue") if c != seen)
    rows = {"seen": {**ROWS["red_cat"], "include": [{"class": "cat", "count": 1, "color": seen}]},
            "other": {**ROWS["red_cat"], "include": [{"class": "cat", "count": 1, "color": other}]}}  # fmt: skip
    reward = build_plugin(
        RewardPluginConfig(name="geneval", kwargs={"clip_path": str(clip_dir)}),
        resources={"geneval_detector": TableDetector(TABLE)},
    )
    samples = [Sample(f"c{k}", [TextPart("x", "user")], meta={"geneval": r})
               for k, r in rows.items()]  # fmt: skip
    service = RewardService([PluginSpec(reward)], decode_images=lambda c: c)
    result = service.score(samples, [traj(s.id) for s in samples], [response(20)] * 2)
    assert result.total.tolist() == [1.0, 0.0]


def test_plugin_config_refusals(m2f_dir):
    def build(kwargs=None, path=None, resources=None):
        cfg = RewardPluginConfig(name="geneval", path=path, kwargs=kwargs or {})
        return build_plugin(cfg, "reward.plugins.0", resources)

    table = {"geneval_detector": TableDetector(TABLE)}
    with pytest.raises(ConfigError, match="has no option 'thresold'.*did you mean 'threshold'"):
        build({"thresold": 0.6}, resources=table)
    with pytest.raises(ConfigError, match=r"kwargs\.threshold: threshold must be a number in"):
        build({"threshold": 1.5}, resources=table)
    with pytest.raises(ConfigError, match=r"kwargs\.partial: partial must be true or false"):
        build({"partial": "yes"}, resources=table)
    with pytest.raises(ConfigError, match=r"kwargs\.detector: unknown detector 'yolo'"):
        build({"detector": "yolo"}, path=str(m2f_dir))
    with pytest.raises(ConfigError, match=r"\.path: plugin 'geneval' needs its detector"):
        build()
    with pytest.raises(ConfigError, match=r"kwargs\.batch_size: .*batch_size must be"):
        build({"batch_size": 0}, path=str(m2f_dir))
    with pytest.raises(ConfigError, match=r"kwargs\.device: acts on nothing"):
        build({"device": "cpu"}, resources=table)
    with pytest.raises(ConfigError, match=r"\.path: .*missing config.json"):
        build(path=str(m2f_dir.parent))


def test_plugin_from_config_runs_the_transformers_detector(m2f_dir):
    cfg = RewardConfig(plugins=[{"name": "geneval", "path": str(m2f_dir),
                                 "kwargs": {"device": "cpu", "batch_size": 2}}])  # fmt: skip
    service = build_reward_service(cfg, decode_images=lambda c: c)
    reward = service.plugins[0].plugin
    assert isinstance(reward.scorer.detector, Mask2FormerDetector)
    assert reward.scorer.detector.batch_size == 2
    images = [np.asarray(im, dtype=np.float32) / 255 for im in _random_images(3, seed=5)]
    found = reward.scorer.detector.detect(images)
    samples = [sample(i, "cat") for i in range(3)]
    responses = [[ImagePart(pixels=im, role="assistant")] for im in images]
    result = service.score(samples, [traj(s.id) for s in samples], responses)
    row = parse_row(ROWS["cat"], "t:1")
    expected = [float(judge(row, f, (48, 40)).correct) for f in found]
    assert result.total.tolist() == expected


# ------------------------------------------------------------------ uniweave score


def write_folder(root: Path, rows: list[dict], levels: list[list[int | None | str]]) -> Path:
    """GenEval's layout: per prompt its row and PNGs of the given grey levels (None: no
    file, "bad": a file that is not an image)."""
    for index, (row, images) in enumerate(zip(rows, levels)):
        folder = root / f"{index:05d}"
        (folder / "samples").mkdir(parents=True)
        (folder / "metadata.jsonl").write_text(json.dumps(row))
        for number, level in enumerate(images):
            path = folder / "samples" / f"{number:04d}.png"
            if level == "bad":
                path.write_bytes(b"not a png")
            elif level is not None:
                Image.fromarray((grey(level) * 255).astype(np.uint8)).save(path)
    return root


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_folder(tmp_path / "images", [ROWS["cat"], ROWS["cat_dog"]],
                        [[10, "bad"], [40, None, 20]])  # fmt: skip


def config_only(tmp_path: Path, m2f_dir: Path) -> Path:
    """A directory with the detector's config.json and no weights: loading it would fail."""
    path = tmp_path / "config_only"
    path.mkdir()
    (path / "config.json").write_text((m2f_dir / "config.json").read_text())
    return path


def test_score_names_missing_and_unreadable_images(folder, tmp_path, m2f_dir, capsys):
    from uniweave.eval.geneval.folder import read_folder
    from uniweave.eval.geneval.score import score_folder
    from uniweave.rewards.geneval.scorer import GenEvalScorer

    scorer = GenEvalScorer(TableDetector(TABLE, batch_size=2))
    loaded = read_folder(folder, COCO_CLASSES)
    result = score_folder(loaded, scorer, tmp_path / "out")
    records = [
        json.loads(line) for line in (tmp_path / "out/results.jsonl").read_text().splitlines()
    ]
    # judged: cat@10 correct; cat_dog@40 correct, cat_dog@20 wrong; then missing + unreadable
    assert [r["correct"] for r in records] == [True, True, False, False, False]
    assert {r["reason"].split(":")[0] for r in records[3:]} == {"missing", "unreadable"}
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["problem_counts"] == {
        "missing": 1,
        "unreadable": 1,
        "unexpected": 0,
        "failed": 0,
    }
    # single_object: 1 of 2 (the unreadable one wrong); two_object: 1 of 3 (the missing one)
    assert summary["images"] == 5 and summary["tags"] == {
        "single_object": 1 / 2,
        "two_object": 1 / 3,
    }
    assert result.count("missing") == 1
    text = (tmp_path / "out/summary.txt").read_text()
    assert (
        "00000/samples/0001.png: unreadable" in text and "00001/samples/0001.png: missing" in text
    )
    skipped = score_folder(loaded, scorer, tmp_path / "skip", missing="skip")
    assert skipped.summary.images == 3
    assert [t.accuracy for t in skipped.summary.tags] == [1.0, 1 / 2]


def test_score_counts_failed_detections_under_on_error_zero(tmp_path):
    from uniweave.eval.geneval.folder import read_folder
    from uniweave.eval.geneval.score import ScoringError, score_folder
    from uniweave.rewards.geneval.scorer import GenEvalScorer

    root = write_folder(tmp_path / "images", [ROWS["cat"]], [[10, 99, 20]])
    scorer = GenEvalScorer(TableDetector(TABLE, batch_size=3))
    with pytest.raises(ScoringError, match=r"00000/samples/0001.png: detection failed"):
        score_folder(read_folder(root), scorer, tmp_path / "a")
    result = score_folder(read_folder(root), scorer, tmp_path / "b", on_error="zero")
    assert [str(p.path).endswith("0001.png") and p.kind for p in result.problems] == ["failed"]
    assert result.summary.images == 3 and result.summary.correct_images == 2 / 3


def test_uniweave_score_command_end_to_end(folder, tmp_path, m2f_dir, capsys):
    out = tmp_path / "out"
    code = main(["score", str(folder), "--detector-path", str(m2f_dir), "--out", str(out),
                 "--batch-size", "2"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Problems: 1 missing, 1 unreadable" in captured.out
    assert "Overall score (avg. over tasks):" in captured.out
    assert len((out / "results.jsonl").read_text().splitlines()) == 5
    assert json.loads((out / "summary.json").read_text())["detector"] == "mask2former"


def test_uniweave_score_refuses_bad_input_before_loading_a_model(folder, tmp_path, m2f_dir, capsys):
    weightless = config_only(tmp_path, m2f_dir)
    row = {**ROWS["cat"], "include": [{"class": "cat", "count": 0}]}
    (folder / "00001" / "metadata.jsonl").write_text(json.dumps(row))
    out = tmp_path / "out"
    args = ["score", str(folder), "--detector-path", str(weightless), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        f"{folder / '00001' / 'metadata.jsonl'}:1: include[0].count: expected an integer >= 1"
        in err
    )
    assert not out.exists()
    (folder / "00001" / "metadata.jsonl").write_text(json.dumps(ROWS["red_cat"]))
    assert main(args) == 2
    assert "include asks for a colour; pass --clip-path" in capsys.readouterr().err
    (folder / "00001" / "metadata.jsonl").write_text(
        json.dumps({**ROWS["cat"], "include": [{"class": "giraffe", "count": 1}]})
    )
    assert main(args) == 2
    assert (
        "include[0].class: 'giraffe' is not a class the detector knows" in capsys.readouterr().err
    )
    assert main([*args[:-2], "--out", str(folder)]) == 2
    assert "--out" in capsys.readouterr().err
