# The paper's language-modeling recipe (Sec. 4 and Table 6) for LLaMA-2-7B on ONE 80 GB GPU:
#   python train.py config/llama2_7b_lm.py --init_from=/path/to/Llama-2-7b-hf \
#       --data_dir=/path/to/long_txt
# Differences from the paper, for one GPU: only the cross-attention trains (the released code's
# choice; the paper also trains the top N-M layers, --train=cross+top, which needs its 8 GPUs with
# ZeRO-3), and the paper's global batch of 128 sequences is 16 here (its per-GPU accumulation). Not
# run on real 7B weights in this project yet.
init_from = "Llama-2-7b-hf"  # an HF-layout LLaMA-2 folder: give yours with --init_from=
task = "lm"
data_dir = ""                # a folder of long .txt documents (the paper: RedPajama, 8K-token
                             # sequences); "" = stdlib .py
n_lower = 4                  # M = 4
chunk_size = 1024            # C
n_chunks = 4                 # X_C = 4 x 1024 tokens ...
block_size = 4096            # ... then X_D = 4096: 8K tokens per sample
chunk_schedule = ""          # no toy curricula
beta_schedule = ""
height = 3
beta = 8
sigma = 0.2                  # split noise sigma = l / 5 (Table 6)
train = "cross"
context_dropout = 0.0        # the frozen upper model already works without X_C
batch_size = 1
gradient_accumulation_steps = 16
learning_rate = 1e-5         # AdamW, cosine schedule (Sec. 4)
min_lr = 1e-6
warmup_iters = 20            # about 1% of the run (Table 6)
beta2 = 0.999
max_iters = 2000             # 2000 x 16 x 8K = 262M tokens (the paper: one epoch over 20B)
ema_decay = 0.0              # the paper's recipe: no weight averaging
eval_interval = 250
eval_iters = 4
eval_chunks = "4"
final_eval_chunks = ""
activation_checkpointing = True
