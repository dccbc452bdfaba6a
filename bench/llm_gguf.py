"""Write a Hugging Face Qwen2 or Llama folder (as `workshop weights` makes one) as a GGUF file
for llama.cpp, unquantised (F32 or BF16): the same weights, so llama.cpp does the same work as
our run. A placeholder vocabulary (token ids only) stands in for the tokenizer the seeded
folders do not have: the benchmark feeds token ids.

    python bench/llm_gguf.py FOLDER OUT.gguf [--type f32|bf16]

Needs the `gguf` package (PyPI), safetensors and numpy; used by bench/llm_side_by_side.py.
"""

import argparse
import json
import pathlib

import numpy as np
from safetensors.numpy import load_file

import gguf


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("out")
    p.add_argument("--type", default="f32", choices=["f32", "bf16"])
    a = p.parse_args()
    folder = pathlib.Path(a.folder)
    c = json.loads((folder / "config.json").read_text())
    arch = {"qwen2": "qwen2", "llama": "llama"}[c["model_type"]]
    w = gguf.GGUFWriter(a.out, arch)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if a.type == "f32" else gguf.LlamaFileType.MOSTLY_BF16)
    vocab = c["vocab_size"]
    # A SentencePiece-style list needs no merges: scores and types are enough to load.
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    tensors = load_file(str(folder / "model.safetensors"))

    def permute(t, n_head):
        # llama.cpp's Llama graph rotates interleaved pairs; Hugging Face's halves.
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in tensors.items():
        if name in names:
            out = names[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{per_layer[rest]}"
        if arch == "llama" and rest_is(name, "q_proj.weight"):
            t = permute(t, heads)
        elif arch == "llama" and rest_is(name, "k_proj.weight"):
            t = permute(t, kv)
        t = t.astype(np.float32)
        if a.type == "bf16" and t.ndim == 2:
            w.add_tensor(out, gguf.quants.quantize(t, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(out, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rest_is(name, suffix):
    return name.endswith(suffix)


if __name__ == "__main__":
    main()
