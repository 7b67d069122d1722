"""effattn's models with their own cache (VQ, ReRoPE, linear, sinks) refused any padded batch, so generate() could not
run prompts of different lengths together. A padded batch now runs row by row, each row with its own cache: every row
must read as its prompt alone, through prefill, decoding and generate(), loaded with effattn or with the bundled code
alone."""

from __future__ import annotations

import pytest
import torch

from effattn.testing import make_model

from .remote import GUARD, SCRIPT

CONVERSIONS = {
    "vq": (["vq-init"], ["--codebook-size", "8", "--window", "4", "--calib-tokens", "1024"], "EffattnVQForCausalLM"),
    "rerope": (["convert"], ["--to", "rerope", "--window", "4"], "EffattnVQForCausalLM"),
    "linear": (["convert"], ["--to", "linear", "--window", "4", "--sinks", "2", "--refine-steps", "2",
                             "--calib-tokens", "2048"], "EffattnLinearForCausalLM"),
    "sinks": (["convert"], ["--to", "swa", "--window", "4", "--sinks", "2"], "EffattnSinksForCausalLM"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One converted tiny model per kind (module-wide: conversions take seconds each)."""
    from effattn.cli import main

    root = tmp_path_factory.mktemp("padded")
    src = make_model(root / "src", "llama", layers=2)
    folders = {}
    for kind, (command, args, _) in CONVERSIONS.items():
        out = root / kind
        try:
            main([*command, str(src), *args, "-o", str(out), "--no-eval"])
        except SystemExit as exc:
            assert exc.code in (0, None), f"{kind}: exit {exc.code}"
        folders[kind] = out
    return folders


def padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """generate()'s layout for prompts of different lengths: padding (id 0) in front, and the attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    return ids, mask


def prompts_of(lengths=(11, 6, 9)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (n,), generator=g) for n in lengths]


def assert_rows_read_alone(model, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts padded in front, at generate()'s positions: each row's logits at its tokens are the prompt's
    alone (float64). Returns (ids, mask, the batch's logits)."""
    ids, mask = padded(prompts)
    width = ids.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for row, p in enumerate(prompts):
            alone = model(input_ids=p[None]).logits[0]
            torch.testing.assert_close(batch[row, width - len(p):], alone, rtol=1e-9, atol=1e-9)
    return ids, mask, batch


@pytest.mark.parametrize("kind", list(CONVERSIONS))
def test_a_padded_batch_reads_as_each_prompt_alone(converted, kind):
    from transformers import AutoModelForCausalLM

    import effattn  # noqa: F401 - registers the model types

    model = AutoModelForCausalLM.from_pretrained(converted[kind], dtype=torch.float64).eval()
    prompts = prompts_of()
    ids, mask, batch = assert_rows_read_alone(model, prompts)
    width = ids.shape[1]
    with torch.no_grad():
        for row, p in enumerate(prompts):
            assert not batch[row, :width - len(p)].any()  # padding is not read: its logits are zeros
        # the same with positions left to the model (each row counts its own tokens), and through the cache:
        # a prefill, then one token per call with the mask grown by a column of ones
        extra = torch.randint(3, 200, (3, 3), generator=torch.Generator().manual_seed(1))
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        torch.testing.assert_close(out.logits, batch, rtol=1e-9, atol=1e-9)
        cache, steps = out.cache, []
        for t in range(extra.shape[1]):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            out = model(input_ids=extra[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
        assert cache.get_seq_length() == width + extra.shape[1]
        for row, p in enumerate(prompts):  # the row alone, prefilled and decoded the same way
            out = model(input_ids=p[None], use_cache=True)
            alone = []
            for t in range(extra.shape[1]):
                out = model(input_ids=extra[row:row + 1, t:t + 1], past_key_values=out.cache, use_cache=True)
                alone.append(out.logits[0, -1])
            torch.testing.assert_close(torch.stack([s[row] for s in steps]), torch.stack(alone), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["vq", "linear", "sinks"])
def test_generate_runs_prompts_of_different_lengths_together(converted, kind):
    from transformers import AutoModelForCausalLM

    import effattn  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(converted[kind], dtype=torch.float64).eval()
    prompts = prompts_of()
    ids, mask = padded(prompts)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(generated[row, ids.shape[1]:], alone[0, len(p):])


def test_padding_anywhere_reads_as_the_row_without_it(converted):
    """The mask decides which tokens a row holds, wherever its zeros are: a row with a hole reads as the row with the
    token taken out (the native models' meaning of a mask, with positions counted over the real tokens)."""
    from transformers import AutoModelForCausalLM

    import effattn  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(converted["linear"], dtype=torch.float64).eval()
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 3] = 0
    mask[1, 6:] = 0  # padding behind
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        kept = [c for c in range(8) if c != 3]
        torch.testing.assert_close(batch[0, kept], model(input_ids=ids[:1, kept]).logits[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(batch[1, :6], model(input_ids=ids[1:, :6]).logits[0], rtol=1e-9, atol=1e-9)
        with pytest.raises(ValueError, match="leaves no token to read"):
            model(input_ids=ids, attention_mask=torch.zeros_like(ids))
        with pytest.raises(ValueError, match="2-D attention mask"):
            model(input_ids=ids, attention_mask=mask[:, :4])


@pytest.mark.parametrize("kind", ["vq"])
def test_the_bundled_code_alone_reads_a_padded_batch(converted, kind, tmp_path):
    """Where effattn is not installed (trust_remote_code=True, importing effattn fails), the same."""
    import subprocess
    import sys

    prompts = prompts_of((7, 4))
    ids, mask = padded(prompts)
    out = tmp_path / "padded.pt"
    script = SCRIPT.split("ids, prefix =")[0].format(
        folder=str(converted[kind]), cls=CONVERSIONS[kind][2], guard=GUARD, guarded=True, dtype="float64") + f"""
ids, mask = torch.tensor({ids.tolist()!r}), torch.tensor({mask.tolist()!r})
with torch.no_grad():
    batch = model(input_ids=ids, attention_mask=mask).logits
    alone = [model(input_ids=ids[r:r + 1, ids.shape[1] - int(mask[r].sum()):]).logits[0] for r in range(ids.shape[0])]
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    gen_alone = [model.generate(ids[r:r + 1, ids.shape[1] - int(mask[r].sum()):], max_new_tokens=4, do_sample=False,
                                pad_token_id=0)[0, -4:] for r in range(ids.shape[0])]
torch.save((batch, alone, gen[:, -4:], gen_alone), {str(out)!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    batch, alone, gen, gen_alone = torch.load(out)
    for row, p in enumerate(prompts):
        torch.testing.assert_close(batch[row, -len(p):], alone[row], rtol=1e-9, atol=1e-9)
        assert torch.equal(gen[row], gen_alone[row])
