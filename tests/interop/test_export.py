"""Export: Hugging Face -> tformer -> Hugging Face gives the same keys and bit-identical tensors, and
``transformers`` loads the result with an empty loading report; a model trained by tformer with a GPT-2-shaped
config runs in ``transformers`` with equal logits; a model that fits no family is refused by field, and a failed
export leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.interop.hf_models import CASES, PAD, TOL, batch, ours, padded, real_error, theirs, tiny_hf
from tformer import DecoderLM, EncoderDecoder, TransformerConfig, load_checkpoint, train
from tformer.interop import InteropError, hf, load_pretrained, save_pretrained


def tensors(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("case", CASES)
def test_round_trip_gives_the_same_tensors_and_an_empty_loading_report(saved, tmp_path, case):
    s = saved(case)
    pretrained = load_pretrained(s.path)
    out = save_pretrained(pretrained.model, tmp_path / "out", generation=pretrained.generation)
    before, after = tensors(s.path), tensors(out)
    assert sorted(after) == sorted(before)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    model, info = type(s.hf).from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    model.set_attn_implementation("eager")
    s.hf.set_attn_implementation("eager")
    b = batch(s.kind)
    assert torch.equal(theirs(model.eval(), s.kind, b), theirs(s.hf, s.kind, b))  # the config survived too


def test_a_model_trained_by_tformer_with_a_gpt2_config_runs_in_transformers(tiny_run, tmp_path):
    gpt2 = dict(position="learned", activation="gelu_tanh", norm_first=True, layer_norm_eps=1e-5)
    train(tiny_run(model=gpt2, steps=4))
    ckpt = load_checkpoint(tmp_path / "run")
    out = save_pretrained(ckpt.model, tmp_path / "hf", tokenizer=ckpt.tokenizer)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model) is transformers.GPT2LMHeadModel
    assert {k: v for k, v in info.items() if v} == {}
    ids, mask = padded([9, 4], left=True, vocab=ckpt.config.vocab_size, pad=0)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        assert (ckpt.model(ids, mask) - logits.logits)[mask].abs().max() < TOL


def test_a_seq2seq_model_with_marians_shape_exports_as_marian(tmp_path):
    cfg = TransformerConfig.tiny(pair_layout="half", activation="relu", logits_bias=True, norm_first=False)
    model = EncoderDecoder(cfg).eval()
    with pytest.raises(InteropError, match="set TransformerConfig.pad_id"):  # Marian's decoder starts from it
        save_pretrained(model, tmp_path / "m")
    model = EncoderDecoder(cfg.replace(pad_id=0)).eval()
    out = save_pretrained(model, tmp_path / "m")
    hf_model, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, output_loading_info=True)
    assert type(hf_model) is transformers.MarianMTModel and {k: v for k, v in info.items() if v} == {}
    assert json.loads((out / "config.json").read_text())["scale_embedding"] is True
    src, src_mask = padded([7, 3], left=False, vocab=cfg.vocab_size, pad=0)
    tgt, tgt_mask = padded([5, 2], left=False, vocab=cfg.vocab_size, seed=1, pad=0)
    with torch.no_grad():
        logits = hf_model.eval()(
            input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask
        ).logits
        assert (model(src, tgt, src_mask, tgt_mask) - logits)[tgt_mask].abs().max() < TOL


def test_a_model_that_fits_no_family_is_refused_by_field(tmp_path):
    model = DecoderLM(TransformerConfig.tiny(position="learned", norm_first=False))  # GPT-2 is Pre-LN
    with pytest.raises(InteropError, match=r"TransformerConfig\.norm_first=False \(GPT-2 needs True\)"):
        save_pretrained(model, tmp_path / "out")
    # biases on the output projection and feed-forward but not on q, k, v: Llama's attention_bias covers all four
    llama_but_biased = dict(position="rotary", pair_layout="half", norm="rms", ffn="gated", bias=True, qkv_bias=False)
    model = DecoderLM(TransformerConfig.tiny(**llama_but_biased))
    with pytest.raises(
        InteropError, match=r"closest: llama, but TransformerConfig\.qkv_bias=False \(Llama needs None or True\)$"
    ):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_nothing_behind(saved, tmp_path, monkeypatch):
    pretrained = load_pretrained(saved("gpt2").path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(pretrained.model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_folder_that_is_not_empty(saved, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(InteropError, match="already exists and is not an empty folder"):
        save_pretrained(load_pretrained(saved("gpt2").path).model, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_sharded_checkpoints_load(saved, tmp_path):
    s = saved("llama")
    s.hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(hf.weight_files(tmp_path)) > 1
    b = batch("lm")
    assert torch.equal(ours(load_pretrained(tmp_path).model, "lm", b), ours(load_pretrained(s.path).model, "lm", b))


def test_a_llama_export_states_its_rope_base_for_transformers_4_and_5(saved, tmp_path):
    pretrained = load_pretrained(saved("llama").path)
    out = save_pretrained(pretrained.model, tmp_path / "out", generation=pretrained.generation)
    config = json.loads((out / "config.json").read_text())
    base = pretrained.model.cfg.rope_base
    # transformers 5 reads rope_parameters; 4 reads rope_theta, and without it would take its default, 10000
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": base} and config["rope_theta"] == base
    assert base != 10000.0  # the tiny model's base is not the default, so a dropped field would show


def test_unknown_special_ids_are_written_as_null_not_left_to_the_classs_defaults(tmp_path):
    model = DecoderLM(TransformerConfig.tiny(position="learned", activation="gelu_tanh", norm_first=True))
    out = save_pretrained(model, tmp_path / "out")  # no tokenizer: no bos, eos or pad
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == dict.fromkeys(
        ("bos_token_id", "eos_token_id", "pad_token_id")
    )
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (None, None)  # absent, GPT-2's class would say 50256


def test_a_quantized_model_is_refused_and_nothing_is_written(saved, tmp_path):
    from tformer import quantize

    model = quantize(load_pretrained(saved("llama").path).model)
    with pytest.raises(InteropError, match=r"a quantized \(int8\) model cannot be exported"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_llama_with_every_bias_loads_and_exports_again(tmp_path):
    """``attention_bias`` and ``mlp_bias`` together are tformer's ``bias=True``: it loaded, but export refused it."""
    model = tiny_hf("llama", attention_bias=True, mlp_bias=True)
    model.save_pretrained(tmp_path / "hf")
    pretrained = load_pretrained(tmp_path / "hf")
    assert pretrained.model.cfg.bias and pretrained.model.cfg.qkv_bias is None
    b = batch("lm")
    assert real_error("lm", b, ours(pretrained.model, "lm", b), theirs(model, "lm", b)) < TOL
    out = save_pretrained(pretrained.model, tmp_path / "out", generation=pretrained.generation)
    before, after = tensors(tmp_path / "hf"), tensors(out)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    again, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {} and again.config.attention_bias and again.config.mlp_bias


def test_an_exported_marian_model_generates_in_transformers(saved, tmp_path):
    """transformers 5 reads the decoder start from generation_config.json: without it, generate refused."""
    pretrained = load_pretrained(saved("marian").path)
    out = save_pretrained(pretrained.model, tmp_path / "out", tokenizer=pretrained.tokenizer)
    assert json.loads((out / "generation_config.json").read_text())["decoder_start_token_id"] == PAD
    model = transformers.MarianMTModel.from_pretrained(out).eval()
    src = torch.tensor([[5, 6, 7, 0]])
    with torch.no_grad():
        tokens = model.generate(src, max_new_tokens=4, do_sample=False, num_beams=1)
    assert tokens[0, 0] == PAD and tokens.shape[1] > 1


def test_a_tokenizer_that_is_not_tformers_is_refused_not_dropped(saved, tmp_path):
    pretrained = load_pretrained(saved("llama").path)
    for wrong in ("hello", object()):
        with pytest.raises(TypeError, match=r"save_pretrained takes tformer's tokenizer \(pretrained.tokenizer"):
            save_pretrained(pretrained.model, tmp_path / "out", tokenizer=wrong)
    assert not (tmp_path / "out").exists()
