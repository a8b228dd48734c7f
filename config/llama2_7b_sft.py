# The paper's instruction-tuning shape (Sec. 4, Table 6) for LLaMA-2-Chat-7B on ONE 80 GB GPU:
#   python train.py config/llama2_7b_sft.py --init_from=/path/to/Llama-2-7b-chat-hf \
#       --data_dir=/path/to/long_txt
# The paper: M = 16, C = 512, h = 3, beta = 8, split noise sigma = l/10, its query-aware search
# (a hidden-vector cosine), lr 1e-5 with cosine decay, warm-up 0.1%, batch 8 (8 GPUs x 1), two
# epochs over RedPajama + LongAlpaca samples of 1.2K-8K tokens, the loss on the response only.
# Here: 8 micro-batches of one on one GPU; the instruction data is this project's passkey task (a
# question whose answer is in X_C, only the answer scored) mixed half and half with language
# modeling on your text, since no instruction set ships offline; the search is every recipe's
# `lexical`, and chunk ids are random in training (model.py); only the cross-attention trains
# (16 x 33.6M = 537M parameters: the whole upper model in fp32 with AdamW would need 108 GB).
# Not run on real 7B weights in this project yet.
init_from = "Llama-2-7b-chat-hf"   # an HF-layout LLaMA-2 chat folder: give yours with --init_from=
task = "mixed"
passkey_frac = 0.5
lm_from = 0
context_dropout = 0.0        # the frozen upper model already works without X_C
data_dir = ""                # a folder of long .txt documents; "" = the standard library's .py
                             # files
n_lower = 16                 # M = 16
chunk_size = 512             # C
n_chunks = 8                 # X_C = 8 x 512 = 4K tokens ...
block_size = 1024            # ... and X_D up to 1K: samples of up to 5K tokens (the paper: 1.2K-8K)
chunk_schedule = ""          # no toy curricula
beta_schedule = ""
height = 3
beta = 8
sigma = 0.1                  # sigma = l / 10 (Table 6)
train = "cross"
batch_size = 1
gradient_accumulation_steps = 8
learning_rate = 1e-5
min_lr = 1e-6
warmup_iters = 2             # about 0.1% of the run (Table 6)
beta2 = 0.999
max_iters = 2000
ema_decay = 0.0              # the paper's recipe: no weight averaging (and 27 GB less for the upper
                             # model's average)
eval_interval = 250
eval_iters = 4
eval_chunks = "8"
final_eval_chunks = "8,32"
activation_checkpointing = True
