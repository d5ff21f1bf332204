"""A real vLLM engine (vllm.LLM, offline) over a tiny random-weight model, with or without the
kvcellar connector: the harness of test_vllm_engine.py. Run as a script (vLLM spawns its engine
core and workers, so the module guard matters):

    python run_engine.py MODEL_DIR SPEC_JSON

SPEC_JSON: {"socket": str|null (null: no connector), "prompts": [[token ids], ...] or
[[[...], ...], ...] (batches run one after another), "max_tokens": int, or one per batch, "kv_space_gib": float,
"max_num_batched_tokens": int, "max_num_seqs": int, "instance_id": str,
"tensor_parallel_size": int}.
Prints one JSON line: {"outputs": [[generated token ids] per prompt, batch after batch]}.
"""
import json
import os
import sys


def make_model(directory: str, seed: int = 0, layers: int = 2, hidden: int = 128,
               vocab: int = 512, max_positions: int = 4096) -> None:
    """A Llama with random weights from `seed` (float32) and a WordLevel tokenizer, saved
    to `directory`: nothing downloaded."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=max_positions,
                         initializer_range=0.5, torch_dtype="float32", bos_token_id=1,
                         eos_token_id=2)
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
    llm = LLM(model=model_dir, dtype="float32", enable_prefix_caching=False, seed=0,
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
        make_model(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        main()
