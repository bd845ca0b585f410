"""What a `--model` path is, for the commands that load one (`megappo eval`, `megappo serve`): the one place
that says what a HF model dir and a megappo checkpoint look like, reads a HF dir's tokenizer and positions,
and says in one line what is wrong. Each command decides what to do with a checkpoint (eval exports it to a
temp dir, serve once beside it). No torch import here."""

from __future__ import annotations

from pathlib import Path

from megappo.parallel.model_dims import language_config


class ModelDirError(ValueError):
    """One line naming the fix; a command prefixes its name."""


def kind_of(path: Path) -> str:
    """"hf" (config.json + safetensors), "checkpoint" (a run's checkpoints/step_N), "role" (one role's megatron
    dist checkpoint: metadata.json + config.json); ModelDirError for anything else."""
    from megappo.utils.checkpoint import MANIFEST

    path = Path(path)
    if not path.exists():
        raise ModelDirError(f"--model {path} does not exist")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf"
    if (path / MANIFEST).exists() or (path / "actor").is_dir():
        return "checkpoint"
    if (path / "metadata.json").is_file() and (path / "config.json").is_file():
        return "role"
    raise ModelDirError(f"--model {path} is neither a HF model dir (config.json + *.safetensors) nor a megappo "
                        "checkpoint (outputs/<run>/checkpoints/step_N)")


def tokenizer_of(model_dir: Path):
    """The HF dir's tokenizer, which must fit its vocabulary; ModelDirError naming the fix."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{model_dir} has no usable tokenizer ({type(e).__name__}); copy the tokenizer files "
                            "(tokenizer.json, tokenizer_config.json) from the model it was trained from") from None
    vocab = language_config(AutoConfig.from_pretrained(str(model_dir))).vocab_size
    if len(tok) > vocab:
        raise ModelDirError(f"tokenizer of {model_dir} has {len(tok)} tokens but the model's vocab_size is {vocab}: "
                            "they do not belong together; use the tokenizer the model was trained with")
    return tok


def positions_of(model_dir: Path) -> int:
    """The positions the model was built for (config.json's max_position_embeddings)."""
    from transformers import AutoConfig

    return int(language_config(AutoConfig.from_pretrained(str(model_dir))).max_position_embeddings)


def check_same_tokenizer(teacher_dir, student_tokenizer_dir) -> None:
    """A teacher scores the student's token ids, so both must read ids as one tokenizer does (the same
    vocabulary, id for id; the models' vocab_size may differ by padding, at least the tokenizer's length).
    ModelDirError naming both otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    student = AutoTokenizer.from_pretrained(str(student_tokenizer_dir))
    try:
        teacher = AutoTokenizer.from_pretrained(str(teacher_dir))
    except (OSError, ValueError):  # a dir without tokenizer files: only its vocab size can be checked
        teacher = None
    vocab = language_config(AutoConfig.from_pretrained(str(teacher_dir))).vocab_size
    if teacher is not None and teacher.get_vocab() != student.get_vocab() or vocab < len(student):
        raise ModelDirError(f"teacher.model {teacher_dir} does not share the student's tokenizer "
                            f"({student_tokenizer_dir}): on-policy distillation scores the student's token ids; "
                            "use a teacher of the same tokenizer (the same family)")
