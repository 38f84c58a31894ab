"""The model shapes and the step points the two GPU benches measure (bench/gpu_step_times.py,
bench/gpu_engine_steps.py), in one place so that their tables line up. Plain data, no imports."""

LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
}
TINY = {  # smoke-test shape: same structure (GQA 4:1), runs on a CPU in seconds
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
}
PREFILL_N = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fmt: off
PREFILL_PREFIX = ((256, 2048), (512, 2048), (512, 8192), (1024, 1024), (1024, 4096),
                  (1024, 8192), (2048, 2048), (2048, 6144), (4096, 4096))  # (new, cached)
# fmt: on
DECODE_B = (1, 8, 32, 64)
DECODE_K = (512, 2048)
DECODE_EXTRA = ((1, 8192), (8, 8192), (128, 512))  # (B, K): more leverage for the k and b fits
# (B, K) of every decode point both benches time, in the order they run
DECODE_POINTS = tuple((b, k) for k in DECODE_K for b in DECODE_B) + DECODE_EXTRA
