# The default run, written out: `python train.py config/tiny.py` is exactly `python train.py` (a test keeps the two
# equal). A tiny SharedLLM (243K parameters, byte tokens) from scratch on a CPU in minutes (README): passkey
# retrieval first, then one batch in three is language modeling on the Python standard library's source.
preset = "tiny"              # dim 64, 4 layers, GQA 4/2 heads
tokenizer = "byte"
task = "mixed"
lm_from = 1500               # passkey alone until here (text from the start keeps the passkey on its loss plateau)
passkey_frac = 0.67
context_dropout = 0.25       # a quarter of the text batches without X_C: a fair "without context" baseline
n_lower = 3                  # M: 3 of 4 layers compress (with this search M = 2 stalled 4 seeds of 10)
chunk_size = 128             # C
n_chunks = 8                 # n: X_C = 8 x 128 tokens at the end: reading among more KVs holds 256 chunks up
chunk_schedule = "1:700,2:1200,4:2000"   # curriculum: 1 chunk, then 2, 4, 8 (never with a step of beta_schedule)
block_size = 64              # T: X_D
height = 3
beta = 8
beta_schedule = "1:300,2:450,4:600"   # no compression for 300 iterations (retrieval is found early), then 2, 4, 8
sigma = 0.0
train = "all"
batch_size = 16
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 2600
ema_decay = 0.998            # evaluate and save the moving average of the weights, restarted at lm_from
eval_chunks = "4,16"
final_eval_chunks = "4,16,64,256"   # at the end: up to 32K context tokens, 64x the training length
final_eval_iters = 0         # at the end as at every eval: 128 haystacks and windows per length (+-2 points)
