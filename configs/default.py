"""Base config: every field attnlab reads, with its meaning; experiment configs override a few."""

import ml_collections

# Model sizes: one table, chosen by `size=NAME` in the config argument
# (e.g. `default.py:size=small`).
SIZES = {
    #        num_layers, d_model, num_heads, d_ff
    'tiny': (2, 64, 4, 256),
    'small': (3, 128, 4, 512),
    'base': (6, 512, 8, 2048),
    'large': (12, 1024, 16, 4096),  # about 150M parameters in the blocks (12·D² a layer)
    'xl': (24, 2048, 16, 8192),  # about 1.2B in the blocks: the pod examples (tools.aot)
}


def parse_arg(arg):
  """'quick,size=small' -> {'quick': True, 'size': 'small'} (the text after `:` in --config)."""
  out = {}
  for item in filter(None, (arg or '').split(',')):
    key, _, value = item.partition('=')
    out[key.strip()] = value.strip() if value else True
  return out


def get_config(arg=None):  # long: one commented line per config field, read top to bottom
  """Returns the base config. `arg`: `quick` shrinks everything for a smoke run; `size=NAME`."""
  args = parse_arg(arg)
  config = ml_collections.ConfigDict()

  config.model = model = ml_collections.ConfigDict()
  model.arch = 'decoder_only'  # decoder_only | encoder_only | encoder_decoder | rnn_seq2seq
  model.attention = 'dense'  # attention variant, a key of layers.attention_variants.VARIANTS
  model.layer_pattern = ''  # hybrid stack: variants repeated over each stack's layers (layer i
  #                           takes entry i mod len), e.g. 'linear,linear,linear,dense'; '' = every
  #                           layer model.attention
  model.attention_impl = 'xla'  # softmax kernel: xla | blockwise | pallas | cudnn (GPU) | splash
  #                                (TPU) | ring
  model.position = 'sinusoidal'  # sinusoidal | learned | rope | alibi | t5_bias | nope | fire |
  #                                kerple (log variant) | xpos
  model.norm = 'layernorm'  # layernorm | rmsnorm
  model.norm_eps = 1e-6  # epsilon of every LayerNorm/RMSNorm in the stacks and of QK-norm (HF:
  #                        Llama rms_norm_eps 1e-5 or 1e-6, GPT-2 layer_norm_epsilon 1e-5)
  # Where the norms sit (layers/block.py), and whether the stack ends with a final norm:
  #   pre       Pre-LN, x + f(norm(x)); final norm
  #   post      Post-LN (the original), norm(x + f(x)); no final norm
  #   deepnorm  DeepNet (Wang et al. 2022): norm(alpha·x + f(x)), value/output/FFN init scaled by
  #             beta; alpha, beta from the arch and num_layers; no final norm
  #   sandwich  Sandwich-LN (CogView): x + norm(f(norm(x))); final norm
  #   rezero    ReZero (Bachlechner et al. 2020): x + g·f(x), scalar gate g = 0 at init per
  #             sublayer, no norm anywhere (model.norm unused); the gates are in the diagnostics
  model.norm_position = 'pre'
  model.deepnorm_scales = 'alpha_beta'  # deepnorm: alpha_beta (the paper) | alpha (beta 1, the
  #                                       standard init) | beta (alpha 1): one scaling alone
  model.ffn = 'relu'  # relu | gelu | gelu_tanh (tanh approximation: GPT-2's gelu_new) | swiglu |
  #                    geglu
  num_layers, d_model, num_heads, d_ff = SIZES[args.get('size', 'small')]
  model.num_layers = num_layers  # Transformer blocks (per stack)
  model.d_model = d_model  # D, model width
  model.num_heads = num_heads  # N, query heads; must divide d_model
  model.num_kv_heads = 0  # K, key/value heads: 0 means num_heads (MHA); 1 is MQA; between is GQA
  model.d_ff = d_ff  # F, feed-forward width; 0 means 4 * d_model
  model.dropout = 0.0  # dropout rate on embeddings and every sublayer output
  model.scan_layers = False  # blocks stacked on a leading `layers` axis, run by one lax.scan:
  #                            compile time flat in depth (not bigbird/performer)
  model.remat = 'none'  # scan_layers: what a block keeps for backprop: none (all) | full (only its
  #                       input; recompute the rest) | dots (the weight matmul outputs)
  model.use_bias = False  # biases in the attention and feed-forward projections (shorthand for
  #                         attention_bias=True and ffn_bias=True; either True turns its biases on)
  model.attention_bias = False  # biases in the q/k/v/o projections (also on with use_bias)
  model.attention_out_bias = True  # with attention biases on: the output projection has one too;
  #                                  False = biases on q/k/v only (Qwen2)
  model.ffn_bias = False  # biases in the feed-forward projections (also on with use_bias)
  model.head_dim = 0  # H, each head's width; 0 means d_model / num_heads. q/k/v project
  #                     D -> N·H and the output N·H -> D (the Flax examples' qkv_dim = N·H)
  model.kernel_init = 'lecun_normal'  # projection kernels: lecun_normal | xavier_uniform (the
  #                                      Flax lm1b/wmt examples'); embeddings are unaffected
  model.embed_scale = 'sqrt_d'  # token embedding on the way in: sqrt_d (x sqrt(D), init std
  #                               1/sqrt(D)) | none (x 1, init std 1, and tied logits / sqrt(D),
  #                               as the Flax examples) | plain (x 1, init std 0.02, tied logits
  #                               h·E^T: HF GPT-2, Llama, Qwen)
  model.tie_output = True  # logits from the token embedding; False: an untied Linear(D, V) with
  #                          a bias (the Flax examples' logits_via_embedding=False)
  model.output_bias = True  # tie_output=False: the untied output layer has a bias (HF: none)
  model.vocab_size = 0  # V, the model's vocabulary; 0 = the tokenizer's. Larger pads the rows
  #                       beyond the tokenizer (HF checkpoints: Qwen2.5's 151936 for 151665)
  model.final_logit_softcap = 0.0  # c > 0: logits c·tanh(logits / c), each in (-c, c) (Gemma 2:
  #                                  30); 0 = off
  model.attention_dropout = 0.0  # dropout on the attention probabilities (xla, blockwise only)
  model.attention_gate = 'none'  # none | headwise | elementwise: each head's output times
  #                               sigmoid(x W) before the output projection (Qiu et al. 2025)
  model.qk_norm = 'none'  # none | rmsnorm: per-head RMSNorm of queries and keys before RoPE
  model.attn_logit_softcap = 0.0  # c > 0: attention logits c·tanh(s / c) (Gemma 2: 50); 0 = off
  model.attention_sinks = False  # a learned logit per head in the softmax's denominator (GPT-OSS)
  model.ffn_dropout = 0.0  # dropout on the feed-forward activations (after the nonlinearity)
  # mixture of experts (layers/moe.py, docs/moe.md); every moe_* field stays at its default while
  # moe_experts = 0
  model.moe_experts = 0  # E routed experts in each MoE block's FFN; 0 = dense FFNs (no MoE)
  model.moe_d_ff = 0  # F_e, each expert's (and shared expert's) width; 0 = d_ff
  model.moe_top_k = 2  # k experts per token (token choice); combine weights renormalised to sum 1
  model.moe_capacity_factor = 0.0  # C > 0: ceil(C·k·T/E) slots per expert per row, overflow
  #                                  dropped (training only); 0 = dropless (ragged_dot)
  model.moe_routing = 'tokens'  # tokens (token choice) | experts (expert choice; encoder_only)
  model.moe_router_jitter = 0.0  # eps: router input x U(1 - eps, 1 + eps) while training
  model.moe_shared_experts = 0  # always-on experts of width moe_d_ff beside the routed
  #                               (DeepSeekMoE)
  model.moe_every = 1  # every n-th block (after moe_first_dense) is MoE, the rest dense; 1 = all
  model.moe_first_dense = 0  # leading blocks of each stack that stay dense
  model.moe_aux_loss = 0.01  # load-balancing loss coefficient (Switch/GShard: E · sum_e f_e·P_e)
  model.moe_z_loss = 0.0  # router z-loss coefficient (ST-MoE: mean logsumexp(logits)^2)
  model.moe_bias_rate = 0.0  # gamma > 0: auxiliary-loss-free balancing (DeepSeek-V3), a selection
  #                             bias per expert, += gamma · sign(mean load - load) after each step
  model.moe_buffer_factor = 0.0  # f >= 1: dropless under mesh.expert > 1, training: a device
  #                                 receives at most f·(its tokens)·k assignments, overflow dropped
  #                                 (MaxText's ragged_buffer_factor); 0 = worst case, none dropped
  # Position conventions, for converting checkpoints. rope rotates pairs (x_i, x_{i+H/2})
  # ("rotate half", as GPT-NeoX and HF transformers' Llama); a checkpoint trained with interleaved
  # pairs (x_2i, x_2i+1: RoFormer, Meta's Llama) needs the output columns of its q and k
  # projections permuted per head, [0, 2, 4, ..., 1, 3, 5, ...] (HF's Llama conversion script).
  # sinusoidal is Vaswani et al.'s interleaved table, PE(p, 2i) = sin(p·w_i),
  # PE(p, 2i+1) = cos(p·w_i), w_i = 10000^(-2i/D); the Flax examples (and tensor2tensor) use
  # [sin | cos] halves instead, so their checkpoints need the model dimension D permuted in every
  # weight that reads or writes the residual stream (ours 2i = theirs i, 2i+1 = theirs D/2 + i).
  model.rope_base = 10000.0  # RoPE base: theta_i = base^(-2i/d) (position=rope)
  model.rope_fraction = 1.0  # share of each head's dims RoPE rotates (1.0 = all; rest unrotated)
  model.rope_scaling = 'none'  # RoPE context scaling: none | pi | ntk | yarn | llama3 | dynamic
  #                              (NTK by each call's length) (eval.py can override)
  model.rope_scaling_factor = 1.0  # its factor s = L_eval / L_train (1.0 = no scaling)
  model.rope_original_length = 0  # L, the pretrained context yarn/llama3/dynamic refer to;
  #                                 0 = data.max_length
  model.rope_low_freq_factor = 1.0  # llama3: wavelengths above L / this are interpolated by s
  model.rope_high_freq_factor = 4.0  # llama3: wavelengths below L / this are kept
  model.rope_yarn_beta_fast = 32.0  # yarn: frequencies turning more than this often over L kept
  model.rope_yarn_beta_slow = 1.0  # yarn: frequencies turning less than this often interpolated
  model.rope_attention_factor = 0.0  # yarn: q and k times this; 0 = the paper's 0.1·ln(s) + 1
  model.t5_num_buckets = 32  # T5 relative-position buckets (position=t5_bias), shared by the layers
  model.t5_max_distance = 128  # T5: distances beyond this share the last bucket
  model.fire_mlp_width = 32  # FIRE: hidden width of the MLP on the interpolated log distance
  model.fire_threshold = 512.0  # FIRE: L_init of the learned threshold L (Li et al.'s listing: 512)
  model.xpos_scale_base = 512.0  # xPos: gamma in q * zeta^(n/gamma), k * zeta^(-m/gamma)
  model.xpos_block = 0  # xPos: w > 0 = blockwise causal attention (a query sees its block of w
  #                       and the previous one; w = data.max_length: plain causal in training)
  model.max_positions = 0  # learned: rows of the position table (>= data.max_length); 0 =
  #                          max(data.max_length, random_positions_max) (GPT-2: 1024)
  model.random_positions_max = 0  # N > 0: training draws sorted position ids from [0, N)
  #                                 (Ruoss et al. 2023; rope | learned | sinusoidal); evaluation
  #                                 uses 0..T-1; 0 = off
  # attention variants (layers/sparse_attention.py, layers/linear_attention.py)
  model.unscaled = False  # scores q·k without the 1/sqrt(d_k) scale (the scaling ablation)
  model.window = 16  # sliding_window/longformer: w; encoders see |i - j| <= w, decoders
  #                    i - w <= j <= i
  model.global_tokens = (0,)  # longformer/bigbird: positions that see and are seen by every
  #                             position
  model.bigbird_block = 16  # bigbird: block size (block-local = own block and both neighbours)
  model.bigbird_random_blocks = 2  # bigbird: random key blocks per query block (fixed per seed)
  model.attention_seed = 0  # bigbird random blocks, performer features: per-layer seeds from this
  model.linformer_k = 32  # linformer: keys/values projected to this many rows
  model.linformer_length = 0  # linformer: length of E, F (longest input); 0 = data.max_length
  model.performer_features = 64  # performer: number of random features M
  model.performer_redraw = 0  # performer: 0 = fixed features, R = redraw every R steps
  model.mla_kv_rank = 32  # mla: d_c, the key/value latent width each token caches (> 0)
  model.mla_q_rank = 0  # mla: d_c', the query latent width; 0 = no query latent (q = W_Q h)
  model.mla_rope_dim = 0  # mla: d_h^R, the decoupled RoPE width per head (one rotary key shared
  #                         by the heads); 0 = H/2 (even, >= 2) under position=rope, else none
  model.deltanet_conv = 4  # gated_deltanet: width of the causal convolutions on q, k, v
  model.deltanet_chunk = 64  # gated_deltanet: chunk length of the training form (any length T)
  # encoder_decoder
  model.share_embeddings = True  # one token embedding for encoder, decoder and output (else two)
  model.decoder_attention = ''  # the decoder's self-attention variant ('' = model.attention), e.g.
  #                               a linformer encoder (no causal form) with a dense decoder
  # encoder_only (masked-token prediction, BERT): which tokens are predicted and how they are hidden
  model.mlm_rate = 0.15  # share of real non-special tokens chosen for prediction
  model.mlm_mask_prob = 0.8  # of the chosen: replaced by <mask>
  model.mlm_random_prob = 0.1  # of the chosen: replaced by a random word (the rest kept as is)
  model.mlm_target_rate = 0.0  # share of rows whose whole target side is <mask>ed instead
  #                              (trains non-autoregressive translation; 0 = plain BERT)
  # rnn_seq2seq (hidden size = d_model; one layer each side)
  model.rnn_cell = 'lstm'  # lstm | gru
  model.rnn_attention = 'bahdanau'  # bahdanau (additive) | luong (multiplicative)
  #                                   | none (bottleneck)
  model.rnn_luong_scale = True  # luong: divide the scores by sqrt(d_model)

  config.train = train = ml_collections.ConfigDict()
  train.steps = 2000  # optimisation steps
  train.batch_size = 64  # sequences per step (global)
  train.learning_rate = 2e-3  # peak learning rate (AdamW)
  train.warmup_steps = 100  # linear warmup from 0 to the peak; 0 allowed (an ablation axis)
  train.schedule = 'cosine'  # after warmup: cosine (to 0) | linear (to 0) | constant
  train.weight_decay = 0.01  # AdamW decoupled weight decay
  train.b1 = 0.9  # Adam beta1
  train.b2 = 0.98  # Adam beta2
  train.grad_clip_norm = 1.0  # clip the global gradient norm; 0 = off
  train.z_loss = 0.0  # PaLM's z-loss: z · (log Z)² per target token added to the objective (1e-4
  #                     in the paper), its mean (log Z)² logged as z_loss; 0 = off
  train.seed = 0  # parameter init, dropout and data order
  train.loss_on = 'target'  # decoder-only loss: target (translation) | all (every token, LM)
  train.checkpoint_every = 500  # steps between checkpoints (and one at the end)
  train.keep_checkpoints = 3  # newest checkpoints kept on disk
  train.grad_accum_steps = 1  # micro-batches per step (gradients accumulated): batch_size / k rows
  #                              in memory at a time, the whole batch's update (dropout and MLM
  #                              masks are drawn per micro-batch)
  train.compute_dtype = 'float32'  # float32 | bfloat16: forward/backward on parameters
  #                                  cast to it; parameters, gradients, optimiser, loss in float32
  train.loss_chunk = 0  # C > 0: output projection and loss in tiles of B·T·C/V tokens (as many
  #                       logits as C vocabulary rows), so the [B, T, V] logits never exist
  #                       (large vocabularies); 0 = the plain path
  train.profile_steps = ''  # 'START,END': a jax.profiler trace of those steps in DIR/profile
  train.skip_nonfinite = False  # skip (and count) a step whose loss or gradient is NaN/inf instead
  #                               of stopping the run
  train.eval_every = 500  # steps between validation passes
  train.eval_batches = 8  # validation batches per pass (0 = the whole split)
  train.log_every = 50  # steps between train-metric lines in metrics.jsonl
  # Training diagnostics (cheap): per-layer gradient norm and update/parameter norm ratio in every
  # step, and every log_every steps a forward pass on `diagnostics_batch` rows for the per-layer
  # attention max logit and entropy and activation RMS; at step 1, DIR/init_grad_norms.json.
  train.diagnostics = True
  train.diagnostics_batch = 8  # rows of the batch the attention/activation pass reads (0 = all)
  train.init_from = ''  # WORKDIR of another run: start from its newest parameters (fresh
  #                       optimiser, step 0); '' = a fresh initialisation. A run with its own
  #                       checkpoints resumes from them instead.

  config.data = data = ml_collections.ConfigDict()
  data.task = 'base'  # base (the toy translation task) | text_pairs (your TSV files of
  #                     source<TAB>target lines) | text_lm (your text files, one document per line)
  #                     | passkey (passkey retrieval in filler of the toy language, generated)
  #                     | python_code (the local Python stdlib's source files, one document each)
  #                     | mqar | induction | selective_copy | memorize (synthetic, generated)
  data.max_length = 64  # training length in tokens
  data.data_dir = './tfds_data'  # where the dataset is generated (first use) and read
  # text_pairs / text_lm: your files, local or gs://, prepared once into
  # data_dir/<task>/vocab<V>-<shared|separate>-<hash of the files and settings>, with the
  # SentencePiece tokenizer (trained on the train file) beside the dataset.
  data.files = ml_collections.ConfigDict({'train': '', 'validation': '', 'test': ''})
  # python_code: the local Python stdlib's .py files (tests left out), one document each, as a
  # text_lm corpus (data/python_code.py); nothing is downloaded.
  data.code_max_files = 0  # python_code: keep the first N files of each split (0 = all)
  data.tokenizer = ''  # text_lm, python_code, passkey: a folder with a Hugging Face tokenizer.json
  #                      (or a workdir of python -m tools.hf import: its tokenizer/), used instead
  #                      of the task's own; '' = the toy / SentencePiece tokenizer of the task
  data.vocab_size = 1000  # text tasks: pieces per SentencePiece model, the 6 special ones included
  data.shared_vocab = True  # text_pairs: one model for source and target (else one per side, their
  #                           ids side by side: V = 2 * vocab_size - 6)
  # passkey: each example is one row of data.max_length tokens, `<bos> filler <key> K V filler
  # <query> K` -> V (filler: toy sentences; K: a toy word); the loss and accuracy are on V alone.
  data.passkey_values = 32  # passkey: size of the value vocabulary (the first N toy words, sorted):
  #                           2 to 160, chance accuracy 1/N per value token
  data.passkey_value_tokens = 1  # passkey: words per value
  data.passkey_depths = (0.0, 1.0)  # passkey: (low, high) of the training depths, drawn uniformly:
  #                                   the share of the filler before the key, 0 (right after <bos>)
  #                                   to 1 (right before the query)
  # passkey with data.tokenizer: "The pass key is 71432. Remember it. 71432 is the pass key." in
  # filler of data.files.train's documents, then "What is the pass key? The pass key is" -> 71432.
  data.passkey_digits = 5  # passkey with data.tokenizer: digits of the pass key (1 to 18)
  # mqar | induction | selective_copy | memorize (data/synthetic.py): generated rows of
  # data.max_length tokens, decoder_only, loss and accuracy on the scored tokens alone.
  data.synthetic = ml_collections.ConfigDict()
  data.synthetic.pairs = 16  # mqar, memorize: key-value pairs a row; induction: tokens of the
  #                            repeated segment; selective_copy: data tokens to copy
  data.synthetic.key_vocab = 64  # mqar: key vocabulary; memorize: keys of the fixed map (its size)
  data.synthetic.value_vocab = 64  # value vocabulary (mqar, memorize); token vocabulary
  #                                  (induction, selective_copy): chance accuracy 1/value_vocab
  data.synthetic.queries = 0  # mqar: keys asked again a row (0 = every pair)
  data.packing = 'none'  # none (one pair per padded row) | segments (packed, attention per pair)
  #                        | stream (packed, attention across pairs: LM / extrapolation studies)
  # S disjoint shards of the training split, each giving batch_size / S rows of every batch: with
  # several processes each reads only the shards of the rows its devices hold. The batches depend
  # on S, not on the process count, so a run resumes under any process count.
  data.shards = 1

  # Device mesh (layers.sharding): axis sizes whose product is the device count (all 1: one
  # device, the first). Parameters and activations carry logical axis names; `rules` maps them to
  # these axes (empty: layers.sharding.DEFAULT_RULES: batch over data x fsdp x expert, parameters'
  # embed over fsdp, heads/mlp/vocab over tensor, length over sequence, MoE experts over expert).
  config.mesh = mesh = ml_collections.ConfigDict()
  mesh.data = 1  # data parallelism: batch rows
  mesh.fsdp = 1  # fully sharded data parallelism: batch rows, and parameters/optimiser state
  mesh.tensor = 1  # tensor (Megatron) parallelism: heads, FFN width, vocabulary
  mesh.sequence = 1  # context parallelism: the length axis (attention_impl='ring' for attention)
  mesh.expert = 1  # expert parallelism: MoE experts (must divide model.moe_experts); batch rows
  mesh.rules = ()  # ((logical name, mesh axis | (axes) | None), ...) overriding the defaults

  if args.get('quick'):
    # A smoke run: tiny model, a few steps, frequent checkpoints.
    model.num_layers, model.d_model, model.num_heads, model.d_ff = SIZES['tiny']
    train.steps = 20
    train.batch_size = 8
    # A constant rate without warmup: the step's program then holds no step count, so quick runs
    # of any length (and their resumes with more steps) compile one program and share its cache.
    train.schedule = 'constant'
    train.warmup_steps = 0
    train.checkpoint_every = 10
    train.eval_every = 10
    train.eval_batches = 2
    train.log_every = 5
    train.diagnostics = False  # a smoke run does not need the per-layer report (one compile less)
  return config
