"""What a fine-tune checks before it touches OUT, converts or loads a model: the same checks for
`effattn finetune --dry-run` and for the run, so that a dry run that passes is a run that starts.

  * the flags and the output folder: --resume and --force are not both given; OUT is named, and it neither
    is nor holds any of the run's inputs (the student, the teacher, a data source, an evaluation corpus,
    the recipe file), which --force, a run killed before its first checkpoint or the final swap would delete;
  * where the run starts (state.decide_start): a new folder, a checkpoint to resume, a finished run, or a
    folder that is not a run of ours, which is refused;
  * the text: every training source can be read and holds at least one block of data.seq_len tokens, every
    evaluation corpus exists and holds one block of eval.seq_len, training and evaluation text are apart.

The checks on the models' configs (the teacher's vocabulary, the student's positions, what trains) are in
plan.plan_finetune, which both paths call too.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..data.corpora import CORPORA, leading_tokens, load_text, shorter_block_fix
from ..errors import EffattnError
from .config import Recipe
from .data import check_disjoint, check_source, source_texts
from .state import RunFolder, Start, decide_start


def check_run(recipe: Recipe, *, resume: bool = False, force: bool = False,
              texts: dict[str, list[str]] | None = None, tokenizer=None, dry_run: bool = False) -> Start:
    """Refuse what the run would refuse later; return where it would start (read-only: nothing is written;
    `dry_run`: a recipe without an output folder is planned, not refused).
    texts: the training sources already read (source -> documents); read here when not given (hub datasets
    then go unchecked for length: reading them means downloading them). tokenizer: the student's, for the
    length checks (loaded here from the student's model when it has one)."""
    if resume and force:
        raise EffattnError("--resume and --force contradict each other (--resume continues OUT's checkpoint, "
                           "--force deletes it)", "pass one of them")
    if recipe.output is None and not dry_run:  # a dry run may plan a recipe before its output is chosen
        raise EffattnError("the recipe has no output folder", "pass -o OUT, or set output: in the recipe")
    for source in recipe.data.sources:
        check_source(source)
    check_disjoint(recipe.data.sources, recipe.eval.corpora)
    if recipe.output is None:
        start = Start(None, False, ["no output folder yet: the run needs -o OUT (or output: in the recipe)"])
    else:
        run = RunFolder(recipe.output)
        start = decide_start(run, recipe.to_dict(), resume=resume, force=force)
        # OUT's own recipe.yaml, run again to continue (as a refusal suggests), is safe unless OUT is replaced
        check_inputs_outside(run.out, recipe, own_recipe=None if start.wipe else run.recipe)
    if tokenizer is None:
        tokenizer = student_tokenizer(recipe)
    if tokenizer is not None:
        check_text_lengths(recipe, tokenizer, texts)
    return start


@contextmanager
def in_finetune_terms():
    """A refusal from the loading code whose fix names a flag `finetune` does not have (--allow-pickle,
    --trust-remote-code) names what a fine-tune can do instead."""
    from ..io.checkpoint import PICKLE_FIX
    from ..io.load import REMOTE_CODE_FIX

    instead = {PICKLE_FIX: "save a safetensors copy (transformers' save_pretrained) and fine-tune that: finetune "
                           "reads no pickled weights",
               REMOTE_CODE_FIX: "finetune runs transformers' and effattn's own model classes only: fine-tune a "
                                "model of a supported family"}
    try:
        yield
    except EffattnError as exc:
        if exc.fix in instead:
            raise EffattnError(exc.what, instead[exc.fix]) from None
        raise


def check_inputs_outside(out: Path, recipe: Recipe, own_recipe: Path | None = None) -> None:
    """OUT must not be, or hold, a file or folder the run reads (but `own_recipe`, OUT's recipe.yaml, may be
    the recipe file)."""
    inputs = [("student.model", recipe.student.model), ("teacher.model", recipe.teacher.model)]
    inputs += [("data.sources", s) for s in recipe.data.sources] + [("eval.corpora", c) for c in recipe.eval.corpora]
    if recipe._source is not None and not (own_recipe is not None and Path(recipe._source).resolve() ==
                                           Path(own_recipe).resolve()):
        inputs += [("the recipe file", recipe._source)]
    out = out.resolve()
    for role, spec in inputs:
        if spec is None or str(spec) in CORPORA or str(spec).startswith("hf:"):
            continue
        path = Path(spec).expanduser()
        if not path.exists():
            continue
        path = path.resolve()
        if path == out or out in path.parents:
            where = "is" if path == out else "holds"
            raise EffattnError(f"the output folder {out} {where} {role} {spec}, which the run would delete when it "
                               "replaces the folder", "write the fine-tuned model to another -o")


def student_tokenizer(recipe: Recipe):
    """The student's tokenizer (its model's, or the model it is converted from), checked against the model's
    vocabulary; None where a config-only folder (planned for another machine) has none. A folder with weights
    and no tokenizer is refused: the run tokenizes its data with the student's."""
    from ..io.checkpoint import Checkpoint
    from ..io.load import as_ref, check_tokenizer_fits, load_tokenizer, tokenizer_missing

    ref = as_ref(recipe.student.model, plan_only=True)
    why = tokenizer_missing(ref.path)
    ckpt = Checkpoint(ref.path, shapes_only=True)
    if why:
        if not ckpt.has_weights:
            return None
        raise EffattnError(f"student.model: {why}; the run tokenizes its data with the student's tokenizer",
                           "copy the tokenizer files of the model it came from into its folder")
    tokenizer = load_tokenizer(ref)
    check_tokenizer_fits(tokenizer, [(f"student.model {recipe.student.model}", ckpt.config)],
                         "copy the tokenizer files of the model it came from into its folder")
    return tokenizer


def check_text_lengths(recipe: Recipe, tokenizer, texts: dict[str, list[str]] | None = None) -> None:
    """Each training source offers one block of data.seq_len tokens (documents joined by EOS, as the run cuts
    them), each evaluation corpus one block of eval.seq_len; only the texts' first tokens are read."""
    need = recipe.data.seq_len
    eos = int(tokenizer.eos_token_id is not None)
    for source in recipe.data.sources:
        if texts is not None and source in texts:
            documents = texts[source]
        elif source.startswith("hf:"):
            continue
        else:
            documents = source_texts(source, recipe.data.text_key)
        have = 0
        for document in documents:
            have += len(leading_tokens(tokenizer, document, need - have)) + eos
            if have >= need:
                break
        if have < need:
            raise EffattnError(f"data source {source!r} has {have} tokens, fewer than one block of data.seq_len {need}",
                               shorter_block_fix(have, "set data.seq_len={}", "add text"))
    need = recipe.eval.seq_len
    for corpus in recipe.eval.corpora:
        have = len(leading_tokens(tokenizer, load_text(corpus), need))
        if have < need:
            raise EffattnError(f"eval.corpora: {corpus} has {have} tokens, fewer than one block of eval.seq_len {need}",
                               shorter_block_fix(have, "set eval.seq_len={}"))
