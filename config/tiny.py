# The default run, written out: `python train.py config/tiny.py` is exactly `python train.py` (a
# test keeps the two equal). A tiny SharedLLM (243K parameters, byte tokens) from scratch on a CPU
# in minutes (README): passkey retrieval first, then one batch in three is language modeling on the
# Python standard library's source.
preset = "tiny"              # dim 64, 4 layers, GQA 4/2 heads
tokenizer = "byte"
task = "mixed"
lm_from = 1500               # passkey alone until here (text from the start stalls the passkey)
passkey_frac = 0.67
context_dropout = 0.25       # a quarter of text batches without X_C: a fair no-context baseline
n_lower = 3                  # M: 3 of 4 layers compress (M = 2 stalled 4 seeds of 10)
chunk_size = 128             # C
n_chunks = 8                 # n: X_C = 8 x 128 tokens at the end (then 256 chunks read well)
chunk_schedule = "1:700,2:1200,4:2000"   # 1 chunk, then 2, 4, 8 (apart from beta's steps)
block_size = 64              # T: X_D
height = 3
beta = 8
beta_schedule = "1:300,2:450,4:600"   # no compression for 300 iterations, then 2, 4, 8
sigma = 0.0
train = "all"
batch_size = 16
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 2600
ema_decay = 0.998            # evaluate and save the weights' moving average (restarts at lm_from)
eval_chunks = "4,16"
final_eval_chunks = "4,16,64,256"   # at the end: up to 32K context tokens, 32x the training length
final_eval_iters = 0         # as at every eval: 128 haystacks and windows a length (+-2 points)
