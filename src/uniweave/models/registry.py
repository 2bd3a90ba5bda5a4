"""Model kinds: every model package declares its own, and model directories load by kind.

A package under `uniweave.models` declares its kind in a `kind.json` next to its
`__init__.py`, naming its loader and builder by "module:attribute" instead of importing
them::

    {"kind": "janus_pro", "load": "uniweave.models.janus_pro:JanusProModel",
     "visual_heads": ["vq"], "transformers_model_types": ["janus"]}

`load` is a model class (whose `from_pretrained(path)` loads a directory) or a `load(path)`
function; the optional `build` is `build(model_cfg, seed, codec_dir, tokenizer)`; the
optional `transformers_model_types` are the `config.json` model_type values that are this
kind. The registry names no model: on the first lookup it reads the `kind.json` of every
subpackage of `uniweave.models` (`pkgutil.iter_modules`) and imports none of them, so
checking a config (`check_model_config`, `uniweave inspect`) loads no model code, and adding
a model touches only its own folder. The package is imported when a model of its kind is
loaded or built (`ModelSpec.load` / `ModelSpec.build`).

A model defined elsewhere (a plugin) registers its kind when it is imported, on its model
class or on a loader function::

    register_model("mymodel", visual_heads=("vq",), transformers_model_types=("my",))(
        MyModel
    )

A subpackage of `uniweave.models` without a `kind.json` is imported on the first lookup, so
its `register_model` calls run. A kind whose implementation is still to come is declared
with `declare_planned_model`; a config naming it is refused with "not implemented yet".

A directory written by uniweave records its kind in `uniweave_model.json`. A transformers
checkpoint directory without one (e.g. a Janus-Pro download) is recognised by the
`model_type` of its `config.json`, as the kinds declared it.

What a run's checks need to know of a model before it is built (`ModelFacts`: its action
spaces, codec grid, prefix sharing) a kind reads from a directory's small files with its
declared `inspect` (`inspect_model`); the `model` config of a kind built from the
config is checked by its declared `check` (`check_model_config`). Neither reads the
model's weights.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from uniweave.config.errors import ConfigError
from uniweave.config.schema import ModelConfig, UniweaveConfig

if TYPE_CHECKING:  # models.base imports torch; a lookup must not
    from uniweave.models.base import UnifiedModel, VisualHead

logger = logging.getLogger(__name__)

MODEL_CONFIG = "uniweave_model.json"
TRANSFORMERS_CONFIG = "config.json"
KIND_FILE = "kind.json"
"""A model package's declaration of its kind (module docstring)."""

Loader = Callable[[Path], "UnifiedModel"]
Builder = Callable[[ModelConfig, int, Path | None, Any], "UnifiedModel"]
"""`build(model_cfg, seed, codec_dir, tokenizer)`: a fresh model from the `model` config
section (`tokenizer` None = the kind's default)."""
Checker = Callable[[ModelConfig], None]
"""`check(model_cfg)`: ConfigError (naming the `model.` key) for a `model` section the
kind's builder would refuse; builds nothing."""


@dataclass(frozen=True)
class ModelFacts:
    """What a model is, as far as a run's config checks need it (no weights read).

    visual_head, n_visual_outputs (VQ codebook size K or BSQ bits L), grid (the codec's
    image grid), supports_prefix_sharing and image_size (the (H, W) pixels of the codec's
    images, what dataset images are read at: `uniweave.models.build.dataset_rows`); with
    `full`, also vocab (token -> id of the tokenizer) and codec_tensors (the codec's
    fitted tensors; None for a codec that does not expose them).
    """

    visual_head: str
    n_visual_outputs: int
    grid: tuple[int, int]
    supports_prefix_sharing: bool = False
    vocab: dict[str, int] | None = None
    codec_tensors: dict[str, Any] | None = None
    image_size: tuple[int, int] | None = None
    channels: int | None = None
    """Colour channels of the codec's images (1 greyscale, 3 RGB; None: not told)."""

    @classmethod
    def of(cls, model: UnifiedModel) -> ModelFacts:
        """The facts of a built model (tokenizer and codec already in memory)."""
        get_vocab = getattr(model.tokenizer, "get_vocab", None)
        tensors = getattr(model.codec, "tensors", None)
        return cls(
            visual_head=model.visual_head,
            n_visual_outputs=int(model.n_visual_outputs),
            grid=tuple(model.codec.grid),
            supports_prefix_sharing=bool(model.supports_prefix_sharing),
            vocab=get_vocab() if callable(get_vocab) else None,
            codec_tensors=tensors() if callable(tensors) else None,
            image_size=tuple(model.codec.image_size),
            channels=getattr(model.codec, "channels", None),
        )


Inspector = Callable[[Path, bool], ModelFacts]
"""`inspect(path, full)`: the `ModelFacts` of a model directory of the kind from its
small files (config, record, codec geometry; with `full` also the tokenizer's vocabulary
and the codec's tensors), no model weights; ValueError / FileNotFoundError naming the
file for a directory the kind's loader would refuse."""


@dataclass(frozen=True)
class ModelSpec:
    """What a model package declares or registers about its kind.

    loader: the model class or `load(path)` function, or its "module:attribute" name
    (imported on first use, by `load`); None for a kind declared but not implemented.
    visual_heads: the visual action spaces the kind can have (`model.visual_head`).
    transformers_model_types: `config.json` model_type values that are this kind.
    builder: builds the model from the config alone (no `model.path`), or its
    "module:attribute" name (imported on first use, by `build`); None when the kind
    always loads a checkpoint.
    check: the config checks of `build` (`Checker`), or its "module:attribute" name
    (imported on first use, by `checker`); None = none beyond the schema's.
    inspect: reads a directory's `ModelFacts` (`Inspector`), or its name (imported on first
    use, by `inspector`); None = not known up front.
    planned: for a declared kind, what it will be (the refusal names it).
    """

    kind: str
    loader: Loader | str | None
    visual_heads: tuple[VisualHead, ...]
    transformers_model_types: tuple[str, ...] = ()
    builder: Builder | str | None = None
    planned: str = ""
    check: Checker | str | None = None
    inspect: Inspector | str | None = None

    @property
    def implemented(self) -> bool:
        return self.loader is not None

    @property
    def builds(self) -> bool:
        """Whether the kind builds from the config alone (known without importing it)."""
        return self.builder is not None

    @property
    def load(self) -> Loader | None:
        """`load(path)` of a model directory (imports the kind's package)."""
        return None if self.loader is None else _as_loader(self.kind, self.loader)

    @property
    def checker(self) -> Checker | None:
        """The config check (imports its module when declared by name); None = none."""
        return _target(self.check) if isinstance(self.check, str) else self.check

    @property
    def inspector(self) -> Inspector | None:
        """The directory reader (imports its module when declared by name); None = none."""
        return _target(self.inspect) if isinstance(self.inspect, str) else self.inspect

    @property
    def build(self) -> Builder | None:
        """The builder (imports the kind's package); None when the kind does not build."""
        return _target(self.builder) if isinstance(self.builder, str) else self.builder


_SPECS: dict[str, ModelSpec] = {}
_discovered = False
T = TypeVar("T")


def _target(name: str) -> Any:
    """The object a "module:attribute" name names, importing the module."""
    module, _, attribute = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def _as_loader(kind: str, target: Any) -> Loader:
    """`load(path)` of a model class (its `from_pretrained`; its `kind` must be `kind`) or
    of a loader function; a "module:attribute" name is imported first."""
    from uniweave.models.base import UnifiedModel

    if isinstance(target, str):
        target = _target(target)
    if isinstance(target, type) and issubclass(target, UnifiedModel):
        if getattr(target, "kind", None) != kind:
            raise ValueError(f"{target.__name__}.kind is not {kind!r}")
        return target.from_pretrained  # type: ignore[attr-defined]  # each kind's class defines it
    if callable(target):
        return target
    raise TypeError(f"model kind {kind!r}: {target!r} is neither a model class nor a loader")


def _add(spec: ModelSpec) -> None:
    old = _SPECS.get(spec.kind)
    if old is not None and old != spec:
        raise ValueError(f"model kind {spec.kind!r} is registered twice")
    for other in _SPECS.values():
        shared = set(other.transformers_model_types) & set(spec.transformers_model_types)
        if other.kind != spec.kind and shared:
            raise ValueError(
                f"transformers model_type {sorted(shared)} claimed by both "
                f"{other.kind!r} and {spec.kind!r}"
            )
    _SPECS[spec.kind] = spec


def register_model(
    kind: str,
    *,
    visual_heads: tuple[VisualHead, ...],
    transformers_model_types: tuple[str, ...] = (),
    build: Builder | None = None,
    check: Checker | None = None,
    inspect: Inspector | None = None,
) -> Callable[[T], T]:
    """Decorator registering `kind`: on a `UnifiedModel` subclass (its `kind` must equal
    `kind`; directories load with its `from_pretrained`) or on a `load(path)` function.
    `build`, `check`, `inspect`: see `ModelSpec`."""

    def register(target: T) -> T:
        loader = _as_loader(kind, target)
        types = tuple(transformers_model_types)
        _add(
            ModelSpec(kind, loader, tuple(visual_heads), types, build, check=check, inspect=inspect)
        )
        return target

    return register


def declare_planned_model(kind: str, *, visual_heads: tuple[VisualHead, ...], planned: str) -> None:
    """Declare a kind whose implementation is still to come (configs naming it are refused
    with "not implemented yet")."""
    _add(ModelSpec(kind, None, tuple(visual_heads), planned=planned))


def read_kind_file(path: Path) -> ModelSpec:
    """The `ModelSpec` a package's `kind.json` declares (module docstring), its loader and
    builder left as names; ValueError naming the file and the field when malformed."""
    data = read_json(path)
    shapes = {
        "kind": "a string",
        "load": "a 'module:attribute' string",
        "build": "a 'module:attribute' string",
        "check": "a 'module:attribute' string",
        "inspect": "a 'module:attribute' string",
        "visual_heads": "a non-empty list of strings",
        "transformers_model_types": "a list of strings",
    }
    for key in data:
        if key not in shapes:
            raise ValueError(f"{path}: unknown field {key!r}; expected {', '.join(shapes)}")
    for key in ("kind", "load", "visual_heads"):
        if key not in data:
            raise ValueError(f"{path}: field {key} missing ({shapes[key]})")
    for key, value in data.items():
        if key in ("visual_heads", "transformers_model_types"):
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            ok = ok and (bool(value) or key != "visual_heads")
        else:
            ok = isinstance(value, str) and (key == "kind" or ":" in value)
        if not ok:
            raise ValueError(f"{path}: field {key} must be {shapes[key]}, got {value!r}")
    return ModelSpec(
        data["kind"],
        data["load"],
        tuple(data["visual_heads"]),
        tuple(data.get("transformers_model_types", ())),
        data.get("build"),
        check=data.get("check"),
        inspect=data.get("inspect"),
    )


def discover() -> dict[str, ModelSpec]:
    """Every kind: on the first call, those the subpackages of `uniweave.models` declare in
    their `kind.json` (read, not imported; a subpackage without one is imported, for its
    `register_model` calls), then every kind registered or declared since."""
    global _discovered
    if not _discovered:
        root = Path(__file__).parent
        for info in pkgutil.iter_modules([str(root)]):
            if not info.ispkg:
                continue
            kind_file = root / info.name / KIND_FILE
            if kind_file.is_file():
                _add(read_kind_file(kind_file))
            else:
                importlib.import_module(f"{__package__}.{info.name}")
        _discovered = True
    return dict(_SPECS)


def _names(specs: dict[str, ModelSpec]) -> str:
    done = sorted(k for k, s in specs.items() if s.implemented)
    planned = sorted(k for k, s in specs.items() if not s.implemented)
    return ", ".join(done) + (f" (planned: {', '.join(planned)})" if planned else "")


def model_spec(kind: str) -> ModelSpec:
    """The registration of an implemented `kind`; ConfigError on `model.kind` otherwise."""
    specs = discover()
    spec = specs.get(kind)
    if spec is None:
        raise ConfigError(f"unknown model kind {kind!r}", key="model.kind", expected=_names(specs))
    if not spec.implemented:
        raise ConfigError(
            f"kind {kind!r} ({spec.planned}) is not implemented yet",
            key="model.kind",
            expected=_names(specs),
        )
    return spec


def check_model_config(model: ModelConfig) -> ModelSpec:
    """Check the `model` config section against the kind's registration, before anything
    is built or written: the kind exists and is implemented, the visual head is one it
    has, a `model.path` is given unless the kind builds from the config (then the kind's
    `check` passes: e.g. UniAR's sizes), and a model directory already at `model.path`
    holds this kind. ConfigError naming the key."""
    spec = model_spec(model.kind)
    if model.visual_head not in spec.visual_heads:
        heads = " or ".join(f"'{h}'" for h in spec.visual_heads)
        raise ConfigError(f"kind '{model.kind}' has a {heads} head", key="model.visual_head")
    if model.path is None:
        if not spec.builds:
            raise ConfigError(
                f"required: kind '{model.kind}' loads a local checkpoint", key="model.path"
            )
        if spec.checker is not None:
            spec.checker(model)
    elif Path(model.path).is_dir():
        try:
            found = model_kind(model.path)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(str(err), key="model.path") from None
        if found != model.kind:
            raise ConfigError(
                f"{model.path} holds a '{found}' model but model.kind is '{model.kind}'",
                key="model.kind",
            )
    return spec


def read_json(path: Path) -> dict:
    """A JSON object file; ValueError naming the path when unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def check_transformers_directory(
    path: Path,
    family: str,
    files: dict[str, tuple[str, ...]],
    model_type: str,
    hint: str = "",
) -> dict:
    """The `config.json` of a local transformers checkpoint of `family`, read only after
    the checks every loader makes before any weights: the directory exists, each entry
    of `files` (what -> alternative names) is present, no config asks for remote code
    (`auto_map`), and `model_type` matches (`hint` is appended to that error). Each
    failure is one line naming the file and the field."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: {family} directory not found")
    for what, names in files.items():
        if not any((path / n).is_file() for n in names):
            raise FileNotFoundError(
                f"{path / names[0]}: missing ({what}; expected {' or '.join(names)})"
            )
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json",
                 "processor_config.json"):  # fmt: skip
        file = path / name
        if file.is_file() and "auto_map" in read_json(file):
            raise ValueError(
                f"{file}: field auto_map asks for remote code; uniweave loads {family} only "
                "with transformers' own classes and never runs a checkpoint's code"
            )
    config = read_json(path / "config.json")
    if config.get("model_type") != model_type:
        raise ValueError(
            f"{path / 'config.json'}: field model_type is {config.get('model_type')!r}, "
            f"not {model_type!r}{hint}"
        )
    return config


def model_kind(path: str | Path) -> str:
    """The kind of the model directory `path` (module docstring); FileNotFoundError when
    it is neither a uniweave model directory nor a recognised transformers checkpoint."""
    path = Path(path)
    cfg_file = path / MODEL_CONFIG
    if cfg_file.is_file():
        kind = read_json(cfg_file).get("kind")
        if not isinstance(kind, str):
            raise ValueError(f"{cfg_file}: no string 'kind'")
        return kind
    hf_file = path / TRANSFORMERS_CONFIG
    if hf_file.is_file():
        model_type = read_json(hf_file).get("model_type")
        kinds = {t: s.kind for s in discover().values() for t in s.transformers_model_types}
        if model_type in kinds:
            return kinds[model_type]
        raise ValueError(
            f"{hf_file}: model_type {model_type!r} is not a supported checkpoint; "
            f"known: {sorted(kinds)}"
        )
    raise FileNotFoundError(
        f"{path}: not a uniweave model directory (missing {MODEL_CONFIG}) nor a transformers "
        f"checkpoint (missing {TRANSFORMERS_CONFIG})"
    )


def inspect_model(path: str | Path, full: bool = False) -> ModelFacts | None:
    """The `ModelFacts` of the model directory `path` (see `Inspector`; `full` adds the
    vocabulary and the codec's tensors), or None for a kind that registered no `inspect`.
    No model weights are read; ValueError / FileNotFoundError as `load_model` would."""
    path = Path(path)
    kind = model_kind(path)
    spec = discover().get(kind)
    if spec is None or not spec.implemented:
        raise ValueError(f"{path}: unknown model kind {kind!r}; known: {_names(discover())}")
    return None if spec.inspector is None else spec.inspector(path, full)


def load_model(path: str | Path) -> UnifiedModel:
    """Load a model directory (written by `save_pretrained`, or a supported transformers
    checkpoint), dispatching on its kind."""
    path = Path(path)
    kind = model_kind(path)
    spec = discover().get(kind)
    load = None if spec is None else spec.load
    if load is None:
        raise ValueError(f"{path}: unknown model kind {kind!r}; known: {_names(discover())}")
    return load(path)


_CODEC_SIZES = {  # codec.json field -> model.codec key, per codec kind (tiny model codecs)
    "vq": {"codebook_size": "codebook_size", "patch": "patch_size"},
    "bsq": {"latent_dim": "bits", "patch": "patch_size", "group": "group"},
}


def saved_sizes(model: ModelConfig) -> dict[str, Any]:
    """{dotted `model.` key: value} of the sizes a tiny model directory at `model.path`
    records (`uniweave_model.json`'s `config`, its `codec/codec.json`); {} without model.path, for another kind, or for a directory that
    records none (the loader's own checks report a broken one)."""
    if model.path is None or not Path(model.path).is_dir():
        return {}
    if model.kind == "uniar":
        return _uniar_sizes(Path(model.path))
    if model.kind != "tiny":
        return {}
    root = Path(model.path)
    try:
        record = read_json(root / MODEL_CONFIG)
    except ValueError:
        return {}
    config = record.get("config")
    if record.get("kind") != "tiny" or not isinstance(config, dict):
        return {}
    config = dict(config)
    if "max_positions" in config:  # the name files written before the size classes used
        config.setdefault("max_position_embeddings", config.pop("max_positions"))
    found = {f"tiny.{k}": config[k] for k in type(model.tiny).model_fields if k in config}
    try:
        codec = read_json(root / "codec" / "codec.json")
    except ValueError:
        codec = {}
    for field, key in _CODEC_SIZES.get(str(codec.get("kind")), {}).items():
        if field in codec:
            found[f"codec.{key}"] = codec[field]
    if str(codec.get("kind")) in _CODEC_SIZES:
        # the codec's geometry: codec.json records it only when not 8x8 greyscale
        size = codec.get("image_size", [8, 8])
        if isinstance(size, list) and len(size) == 2 and size[0] == size[1]:
            found["codec.image_size"] = size[0]
        found["codec.channels"] = codec.get("channels", 1)
    return {f"model.{key}": value for key, value in found.items()}


_QWEN_SIZES = {  # a Qwen3-VL config.json's text_config field -> model.tiny key
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
}


def _uniar_sizes(root: Path) -> dict[str, Any]:
    """The `model.tiny` sizes a UniAR directory's Qwen3-VL `config.json` records (its
    text decoder's; Qwen3-VL has no depthwise mixer, so `mixer_kernel` 0), {} when it
    records none (the loader's own checks report a broken directory)."""
    try:
        text = read_json(root / "config.json").get("text_config")
    except ValueError:
        return {}
    if not isinstance(text, dict):
        return {}
    found: dict[str, Any] = {
        f"model.tiny.{key}": text[f] for f, key in _QWEN_SIZES.items() if f in text
    }
    return {**found, "model.tiny.mixer_kernel": 0} if found else {}


def _check_codec_path(cfg: UniweaveConfig) -> None:
    """With a tiny `model.path`, a `model.codec.path` acts only as the codec the model
    directory holds (`<model.path>/codec`, which the loader reads): the same `codec.json`
    and weights bytes are accepted (a recipe's pre-fitted codec, evaluated with the model
    trained on it), anything else is a ConfigError naming the key."""
    given = cfg.model.codec.path
    if cfg.model.kind != "tiny" or cfg.model.path is None or given is None:
        return
    if not Path(cfg.model.path).is_dir():
        return  # no model directory: the loader's own error names model.path
    own = Path(cfg.model.path) / "codec"
    same = own.is_dir() and Path(given).is_dir()
    for name in ("codec.json", "codec.safetensors"):
        if not same:
            break
        a, b = own / name, Path(given) / name
        same = a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()
    if not same:
        raise ConfigError(
            "acts only for a model built from the config (model.path null); model.path "
            f"{cfg.model.path} is loaded with its own image codec ({own}, not {given})",
            key="model.codec.path",
        )


def with_saved_sizes(cfg: UniweaveConfig) -> UniweaveConfig:
    """`cfg` itself, or, when `model.path` is a tiny model directory whose sizes differ from
    `model.tiny` / `model.codec` (`saved_sizes`), `cfg` with the loaded model's sizes in
    their place (validated again), stated in the log: what `config.yaml`, `uniweave inspect`
    and the config hash then record is the model that runs, not sizes it does not have.
    A size the config gives explicitly (`uniweave.config.base.changed`) that differs does
    not act: a ConfigError naming its key (the schema's "acts only" rule for a loaded
    model, `uniweave.config.schema._built_here`, which cannot read the directory)."""
    _check_codec_path(cfg)
    current = cfg.model.model_dump()
    found = {
        key: value
        for key, value in saved_sizes(cfg.model).items()
        if current[key.split(".")[1]][key.split(".")[2]] != value
    }
    if not found:
        return cfg
    from uniweave.config import validate_config
    from uniweave.config.base import changed

    for key, value in found.items():  # a value given that the loaded model does not have
        _, section, name = key.split(".")
        if changed(getattr(cfg.model, section), name):
            what = "sizes" if section == "tiny" else "image codec"
            raise ConfigError(
                "acts only for a model built from the config (model.path null); model.path "
                f"{cfg.model.path} is loaded with its own {what} ({name} {value})",
                key=key,
            )

    was = ", ".join(
        f"{k} {current[k.split('.')[1]][k.split('.')[2]]} -> {v}" for k, v in found.items()
    )
    logger.warning("model sizes from the model at %s (not the config's): %s", cfg.model.path, was)
    raw = cfg.model_dump(mode="json")
    for key, value in found.items():
        _, section, name = key.split(".")
        raw["model"][section][name] = value
    return validate_config(raw, source=f"the sizes recorded in {cfg.model.path}")
