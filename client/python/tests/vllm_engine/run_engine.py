"""A real vLLM engine (vllm.LLM, offline) over a tiny random-weight model, with or without the
kvcellar connector: the harness of test_vllm_engine.py. Run as a script (vLLM spawns its engine
core and workers, so the module guard matters):

    python run_engine.py MODEL_DIR SPEC_JSON

SPEC_JSON: {"socket": str|null (null: no connector), "prompts": [[token ids], ...] or
[[[...], ...], ...] (batches run one after another), "max_tokens": int, or one per batch, "kv_space_gib": float,
"max_num_batched_tokens": int, "max_num_seqs": int, "instance_id": str,
"tensor_parallel_size": int, "enable_prefix_caching": bool}.
Prints one JSON line: {"outputs": [[generated token ids] per prompt, batch after batch]}.
"""
import json
import os
import sys


# Sliding window of the hybrid model (tokens): two 32-token pages of window KV per hit.
GEMMA3_WINDOW = 64


def make_model(directory: str, seed: int = 0, layers: int = 2, hidden: int = 128,
               vocab: int = 512, max_positions: int = 4096, arch: str = "llama") -> None:
    """A model with random weights from `seed` (float32) and a WordLevel tokenizer, saved
    to `directory`: nothing downloaded. `arch` "llama"; "gemma3": a hybrid model, three
    sliding-window layers of GEMMA3_WINDOW tokens beside one full-attention layer (Gemma 3's
    text model), which vLLM's hybrid KV cache manager keeps in four KV cache groups; "lfm2":
    three short-convolution layers (recurrent state) beside one full-attention layer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                              LlamaForCausalLM, Lfm2Config, Lfm2ForCausalLM,
                              PreTrainedTokenizerFast)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  max_position_embeddings=max_positions, torch_dtype="float32", bos_token_id=1,
                  eos_token_id=2)
    if arch == "lfm2":
        # LFM2: short-convolution layers (recurrent state, vLLM's MambaSpec) beside one
        # full-attention layer. vLLM 0.32's lfm2.py reads config.conv_dim and block_dim, which
        # transformers' Lfm2Config no longer writes: added to config.json as LFM2's own carry.
        common.pop("head_dim")
        config = Lfm2Config(**common, num_hidden_layers=4, initializer_range=0.1,
                            conv_L_cache=3, block_multiple_of=32, pad_token_id=0,
                            tie_word_embeddings=False,
                            layer_types=["conv", "conv", "full_attention", "conv"])
        Lfm2ForCausalLM(config).to(torch.float32).save_pretrained(directory)
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            saved = json.load(f)
        saved.update(conv_dim=hidden, block_dim=hidden)
        with open(path, "w") as f:
            json.dump(saved, f, indent=2)
    elif arch == "gemma3":
        # Untied embeddings and a smaller init than the Llama's: with Gemma's scaled, tied
        # embeddings a random model only repeats the prompt's last token, whatever its KV.
        config = Gemma3TextConfig(**common, num_hidden_layers=4, initializer_range=0.1,
                                  query_pre_attn_scalar=hidden // 4, pad_token_id=0,
                                  sliding_window=GEMMA3_WINDOW, tie_word_embeddings=False,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"])
        Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(directory)
    else:
        config = LlamaConfig(**common, num_hidden_layers=layers, initializer_range=0.5)
        LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def main() -> None:
    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("socket"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvcellarConnector", kv_role="kv_both",
            kv_connector_module_path="kvcellar.integrations.vllm",
            kv_connector_extra_config={"socket": spec["socket"],
                                       "instance_id": spec.get("instance_id", "vllm-test")})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 1)))
    llm = LLM(model=model_dir, dtype="float32", seed=0,
              enable_prefix_caching=spec.get("enable_prefix_caching", False),
              max_model_len=spec.get("max_model_len", 2048),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
              max_num_seqs=spec.get("max_num_seqs", 16), block_size=spec.get("block_size", 32),
              enforce_eager=True, tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              **kw)
    batches = spec["prompts"]
    if batches and isinstance(batches[0][0], int):
        batches = [[p] for p in batches]
    max_tokens = spec.get("max_tokens", 16)
    if not isinstance(max_tokens, list):
        max_tokens = [max_tokens] * len(batches)
    outputs = []
    for batch, n in zip(batches, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        res = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in res]
    print(json.dumps({"outputs": outputs}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--make-model":
        make_model(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0,
                   arch=sys.argv[4] if len(sys.argv) > 4 else "llama")
    else:
        main()
