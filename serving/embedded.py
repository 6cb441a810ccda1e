"""Build the embedded deployment's tiny OPT models locally: random weights, a tokenizer trained
here, no download. Their output is meaningless text; they exist so the whole system runs offline.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path

from config.schema import TinyBuild
from workloads.examples import corpus

log = logging.getLogger(__name__)

# OPT's ids are pad=1, bos=eos=2; any fixed choice works as long as config.json agrees with it.
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
VOCAB_TARGET = 4096


def ensure_built(path: str | Path, build: TinyBuild) -> Path:
    """The model directory at `path`, built first if it is missing or was built from another spec.

    Safe when several processes ask at once: one builds under a file lock, into a temporary
    directory that is renamed into place, and the others wait and reuse it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = build.model_dump_json()
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp(path) == stamp:
            return path
        log.info("building tiny model %s (%s)", path, stamp)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
            _build(Path(tmp), build)
            (Path(tmp) / "build.json").write_text(stamp)
            Path(tmp).chmod(0o755)  # mkdtemp makes it private; the model is not a secret
            if path.exists():
                shutil.rmtree(path)
            Path(tmp).rename(path)
            Path(tmp).mkdir()  # TemporaryDirectory removes it on exit
    return path


def _stamp(path: Path) -> str | None:
    try:
        return (path / "build.json").read_text()
    except OSError:
        return None


_IMPORTING = threading.Lock()
"""transformers' lazy top-level module is not safe to import from several threads at once: the
embedded deployment builds its three models in threads, and on a machine without them one got
`ImportError: cannot import name 'OPTConfig' from 'transformers'` and the server did not start."""


def _build(out: Path, build: TinyBuild) -> None:
    # Imported here: transformers and torch take seconds to import and only the build needs them.
    with _IMPORTING:
        import torch
        from tokenizers import (
            Tokenizer,
            decoders,
            models,
            pre_tokenizers,
            processors,
            trainers,
        )
        from transformers import OPTConfig, PreTrainedTokenizerFast
        from transformers.models.opt.modeling_opt import OPTForCausalLM

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus()], trainer)
    # Like OPT's tokenizer, prepend </s> as the beginning-of-sequence token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="</s> $A", special_tokens=[("</s>", EOS_ID)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="</s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=build.max_positions,
    ).save_pretrained(out)

    torch.manual_seed(build.seed)
    config = OPTConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=build.hidden_size,
        word_embed_proj_dim=build.hidden_size,
        num_hidden_layers=build.num_layers,
        num_attention_heads=build.num_heads,
        ffn_dim=build.ffn_dim,
        max_position_embeddings=build.max_positions,
        pad_token_id=PAD_ID,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
    )
    OPTForCausalLM(config).save_pretrained(out)
    params = json.loads((out / "config.json").read_text())
    log.info("built %s: vocab %d, hidden %d", out, params["vocab_size"], params["hidden_size"])


def main() -> None:
    """`python -m serving.embedded [--deployment NAME]`: build a deployment's tiny models now."""
    import argparse

    from config import DEFAULT_PATH, load_deployment

    parser = argparse.ArgumentParser(prog="python -m serving.embedded", description=main.__doc__)
    parser.add_argument("--deployment", default="embedded")
    parser.add_argument("--config", default=str(DEFAULT_PATH))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for replica in load_deployment(args.config, args.deployment).replicas:
        if replica.build is not None:
            print(ensure_built(replica.source, replica.build))


if __name__ == "__main__":
    main()
