#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target: small valid inputs and near-valid ones (one field
wrong), deterministic, no downloads. Usage: fuzz/make_seeds.py [--check]

The checkpoint targets' valid index.json and manifest.json are what checkpoint_fixture.h writes
(the store's own writer; Python has no xxh3 here): they are kept in corpus/checkpoint_*/valid*
and only their variants are generated. Rerunning rewrites the generated files, nothing else.
"""
import hashlib
import hmac
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(ROOT, 'corpus')
MASK = (1 << 64) - 1


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), 'wb') as f:
        f.write(data)


# ---- yaml_config -------------------------------------------------------------------------------
def yaml_config():
    base = 'model: {preset: gpt2-tiny}\ndata: {path: train.tok, seq_len: 32}\n'
    seeds = {
        'minimal.yaml': base,
        'full.yaml': base + '''training: {steps: 20, global_batch: 8, micro_batch: 4, seed: 3, grad_clip: 1.0,
  eval_every: 5, eval_batches: 2, log_every: 1, backend: cpu, gemm: openblas, huge_pages: false,
  threads: 2, stop_at: 10}
optimizer: {lr: 0.001, min_lr: 0.0001, warmup_steps: 2, beta1: 0.9, beta2: 0.95, eps: 1.0e-8,
  weight_decay: 0.1}
checkpoint: {dir: ckpt, every: 5, resume: true, keep: 2, async: false}
output: {metrics: m.jsonl, events: e.jsonl, data_order: o.txt, rank_params: params}
elastic: {hosts_file: hosts, replace_failed: true, prepare_steps: 1, reshard_transport: network,
  control_store: "http://127.0.0.1:2379"}
''',
        'parallel.yaml': base + '''training: {steps: 10, global_batch: 8, micro_batch: 2}
parallel: {dp: 2, tp: 1, pp: 2, virtual_stages: 1, schedule: 1f1b, zero_stage: 1,
  layers_per_stage: [1, 1], rank_order: tp-pp-dp, timeout_s: 30, bucket_mb: 4}
''',
        'timeline.yaml': base + '''training: {steps: 10, global_batch: 8}
parallel: {dp: 2}
timeline:
  - {at_step: 3, parallel: {dp: 1, pp: 2}}
  - {at_step: 6, workers: 2}
''',
        'custom_model.yaml': '''model: {family: llama, n_layer: 2, n_embd: 32, n_head: 4, n_kv_head: 2,
  ffn_hidden: 64, vocab_size: 300, max_seq_len: 64, norm_eps: 1.0e-5, rope_theta: 10000,
  tie_embeddings: false, bias: false, name: tiny}
data: {path: /abs/train.tok, seq_len: 64, eval_fraction: 0.1, seed: 9}
''',
        'plan_file.yaml': base + 'parallel: {plan_file: plan.json, timeout_s: 5}\n',
        'duplicate_key.yaml': base + 'training: {steps: 1}\ntraining: {steps: 2}\n',
        'unknown_key.yaml': base + 'training: {stpes: 1}\n',
        'wrong_type.yaml': base + 'training: {steps: [1, 2], grad_clip: .inf}\n',
        'anchors.yaml': 'a: &x {preset: gpt2-tiny}\nmodel: *x\ndata: {path: t, seq_len: *x}\n',
        'complex_key.yaml': base + '? [a, b]\n: 1\n',
        'bad_choice.yaml': base + 'training: {gemm: mkl}\nelastic: {reshard_transport: carrier}\n',
        'not_a_map.yaml': '- model\n- data\n',
        'malformed.yaml': 'model: {preset: gpt2-tiny\n  data: [\n',
        'timeline_bad.yaml': base + 'timeline: {at_step: 1}\n',
        'big_numbers.yaml': base + 'training: {steps: 9223372036854775807, global_batch: '
                            '9223372036854775807, micro_batch: -9223372036854775808}\n'
                            'parallel: {dp: 2147483647, tp: 2147483647}\n',
    }
    for name, text in seeds.items():
        put('yaml_config', name, text)
    examples = os.path.join(ROOT, '..', 'examples')
    for f in sorted(os.listdir(examples)):
        if f.endswith('.yaml'):
            put('yaml_config', 'example-' + f, open(os.path.join(examples, f)).read())


# ---- safetensors -------------------------------------------------------------------------------
DTYPE_SIZE = {'F32': 4, 'BF16': 2, 'F16': 2, 'I32': 4, 'I64': 8, 'U8': 1, 'U16': 2}


def safetensors(tensors, metadata=None, pad=True, fix=None):
    """tensors: [(name, dtype, shape)]; data is a byte pattern. fix(header) may break it."""
    header, offset, data = {}, 0, b''
    if metadata is not None:
        header['__metadata__'] = metadata
    for name, dtype, shape in tensors:
        n = DTYPE_SIZE.get(dtype, 4)
        for d in shape:
            n *= d
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + n]}
        data += bytes((offset + i) % 251 for i in range(n))
        offset += n
    if fix:
        fix(header)
    text = json.dumps(header, separators=(',', ':'))
    if pad:
        text += ' ' * ((8 - len(text) % 8) % 8)
    return struct.pack('<Q', len(text)) + text.encode() + data


def safetensors_seeds():
    t = [('w', 'F32', [2, 3]), ('b', 'BF16', [3]), ('i', 'I64', [1]), ('u', 'U8', [5])]
    put('safetensors', 'valid.safetensors', safetensors(t, {'format': 'pt'}))
    put('safetensors', 'all_dtypes.safetensors',
        safetensors([(k.lower(), k, [2, 2]) for k in DTYPE_SIZE]))
    put('safetensors', 'empty.safetensors', safetensors([]))
    put('safetensors', 'scalar_and_empty.safetensors',
        safetensors([('s', 'F32', []), ('e', 'F16', [0, 4])]))
    put('safetensors', 'f64.safetensors', safetensors([('d', 'F64', [2])]))
    put('safetensors', 'unknown_dtype.safetensors', safetensors([('d', 'Q4', [2])]))

    def gap(h):
        h['b']['data_offsets'] = [h['b']['data_offsets'][0] + 2, h['b']['data_offsets'][1] + 2]
    put('safetensors', 'gap.safetensors', safetensors(t, fix=gap))

    def overlap(h):
        h['b']['data_offsets'] = [0, 6]
    put('safetensors', 'overlap.safetensors', safetensors(t, fix=overlap))

    def huge_shape(h):
        h['w']['shape'] = [1 << 62, 1 << 62]
    put('safetensors', 'huge_shape.safetensors', safetensors(t, fix=huge_shape))

    def bad_meta(h):
        h['__metadata__'] = {'k': 1}
    put('safetensors', 'bad_metadata.safetensors', safetensors(t, {}, fix=bad_meta))
    put('safetensors', 'truncated.safetensors', safetensors(t)[:-3])
    put('safetensors', 'long_header_len.safetensors', struct.pack('<Q', 1 << 40) + b'{}')
    put('safetensors', 'not_json.safetensors', struct.pack('<Q', 8) + b'{"a":[1,')


# ---- hf_index / hf_config ----------------------------------------------------------------------
def hf_seeds():
    put('hf_index', 'valid.json', json.dumps({
        'metadata': {'total_size': 1024},
        'weight_map': {'transformer.wte.weight': 'model-00001-of-00002.safetensors',
                       'transformer.h.0.ln_1.weight': 'model-00002-of-00002.safetensors'}}))
    put('hf_index', 'escape.json', json.dumps({'weight_map': {'a': '../x.safetensors', 'b': '/etc/passwd'}}))
    put('hf_index', 'dots.json', json.dumps({'weight_map': {'a': '..', 'b': '.', 'c': ''}}))
    put('hf_index', 'not_string.json', json.dumps({'weight_map': {'a': 3}}))
    put('hf_index', 'no_map.json', json.dumps({'metadata': {}}))
    put('hf_index', 'array.json', '[{"weight_map": {}}]')
    gpt2 = {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'n_layer': 2, 'n_embd': 32,
            'n_head': 4, 'n_inner': None, 'vocab_size': 300, 'n_positions': 64,
            'layer_norm_epsilon': 1e-5, 'activation_function': 'gelu_new',
            'tie_word_embeddings': True, 'bos_token_id': 0, 'torch_dtype': 'float32'}
    llama = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'num_hidden_layers': 2,
             'hidden_size': 32, 'num_attention_heads': 4, 'num_key_value_heads': 2,
             'intermediate_size': 64, 'vocab_size': 300, 'max_position_embeddings': 128,
             'rms_norm_eps': 1e-6, 'rope_theta': 500000.0, 'hidden_act': 'silu', 'head_dim': 8,
             'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0},
             'attention_bias': False, 'tie_word_embeddings': False}
    put('hf_config', 'gpt2.json', json.dumps(gpt2, indent=2))
    put('hf_config', 'llama.json', json.dumps(llama, indent=2))
    put('hf_config', 'arch_only.json', json.dumps({k: v for k, v in gpt2.items() if k != 'model_type'}))
    put('hf_config', 'mistral.json', json.dumps(dict(llama, model_type='mistral')))
    put('hf_config', 'huge.json', json.dumps(dict(gpt2, n_layer=2147483647, n_embd=2147483647,
                                                  n_head=1, vocab_size=2147483647)))
    put('hf_config', 'float_eps.json', json.dumps(dict(llama, rms_norm_eps=1e300, rope_theta=-1)))
    put('hf_config', 'rope_scaling.json', json.dumps(dict(llama, rope_scaling={'type': 'linear'})))
    put('hf_config', 'bad_head_dim.json', json.dumps(dict(llama, head_dim=7)))
    put('hf_config', 'not_json.json', '{"model_type": "gpt2", ')


# ---- checkpoint_index / checkpoint_manifest ----------------------------------------------------
def checkpoint_seeds():
    for target, name in (('checkpoint_index', 'valid-index.json'),
                         ('checkpoint_manifest', 'valid-manifest.json')):
        path = os.path.join(CORPUS, target, name)
        if not os.path.exists(path):
            print(f'{path} missing: write it with TESSEL_FUZZ_DUMP_FIXTURE (fuzz/README.md)')
            continue
        doc = json.load(open(path))
        variants = {}
        if target == 'checkpoint_index':
            t = doc['tensors']
            v = json.loads(json.dumps(doc)); v['tensors']['b']['pieces'].pop(); variants['gap'] = v
            v = json.loads(json.dumps(doc)); v['tensors']['w']['shape'] = [4, 4]; variants['shape'] = v
            v = json.loads(json.dumps(doc)); v['tensors']['w']['pieces'][0]['chunk_bytes'] = 1
            variants['chunks'] = v
            v = json.loads(json.dumps(doc)); v['tensors']['w']['pieces'][0]['chunk_bytes'] = 0
            variants['chunk0'] = v
            v = json.loads(json.dumps(doc))
            v['tensors']['b']['pieces'][1]['box'] = [[2, 6]]
            variants['overlap'] = v
            v = json.loads(json.dumps(doc)); v['tensors']['w']['dtype'] = 'f64'; variants['dtype'] = v
            v = json.loads(json.dumps(doc))
            v['tensors']['w']['pieces'][0]['file'] = '../etc'
            variants['file'] = v
            v = json.loads(json.dumps(doc)); v['files'] = {}; variants['nofiles'] = v
            v = json.loads(json.dumps(doc)); v['version'] = 2; variants['version'] = v
            v = json.loads(json.dumps(doc)); v['tensors']['w']['shape'] = [1 << 40, 1 << 40]
            variants['huge'] = v
            del t
        else:
            v = json.loads(json.dumps(doc)); v['index']['file'] = '../index.json'; variants['escape'] = v
            v = json.loads(json.dumps(doc)); v['index']['file'] = 'rank-00000.safetensors'
            variants['not_index'] = v
            v = json.loads(json.dumps(doc)); v['version'] = 1.5; variants['version'] = v
            v = json.loads(json.dumps(doc)); v['meta'] = []; variants['meta'] = v
            v = json.loads(json.dumps(doc)); v['index']['bytes'] = -1; variants['bytes'] = v
            v = json.loads(json.dumps(doc)); del v['format']; variants['format'] = v
        for k, v in variants.items():
            put(target, f'{k}.json', json.dumps(v))


# ---- megatron ----------------------------------------------------------------------------------
FMT = {1: 'B', 2: 'b', 3: 'h', 4: 'i', 5: 'q', 6: 'd', 7: 'f', 8: 'H'}


def megatron(docs, code=8, pointers=None, sizes=None, doc_idx=None, version=1, cut=0):
    item = struct.calcsize('<' + FMT[code])
    bin_ = b''.join(struct.pack('<%d%s' % (len(d), FMT[code]), *d) for d in docs)
    sizes = sizes if sizes is not None else [len(d) for d in docs]
    if pointers is None:
        pointers, p = [], 0
        for s in sizes:
            pointers.append(p)
            p += s * item
    doc_idx = doc_idx if doc_idx is not None else list(range(len(docs) + 1))
    idx = b'MMIDIDX\0\0' + struct.pack('<QBQQ', version, code, len(sizes), len(doc_idx))
    idx += struct.pack('<%di' % len(sizes), *sizes) + struct.pack('<%dq' % len(pointers), *pointers)
    idx += struct.pack('<%dq' % len(doc_idx), *doc_idx)
    if cut:
        idx = idx[:-cut]
    # The target's input: u16 length of .bin, .bin, .idx.
    return struct.pack('<H', len(bin_)) + bin_ + idx


def megatron_seeds():
    docs = [[1, 2, 3], [4, 5], [100, 0, 7, 9]]
    for code in (1, 2, 3, 4, 5, 8):
        put('megatron', f'valid-code{code}.bin+idx', megatron(docs, code))
    put('megatron', 'float.bin+idx', megatron(docs, 7))
    put('megatron', 'empty.bin+idx', megatron([]))
    put('megatron', 'empty_docs.bin+idx', megatron([[], [1], []]))
    put('megatron', 'noncontiguous.bin+idx', megatron(docs, 8, pointers=[10, 0, 0]))
    put('megatron', 'outside.bin+idx', megatron(docs, 8, pointers=[0, 6, 100]))
    put('megatron', 'negative.bin+idx', megatron(docs, 2, sizes=[3, -1, 4]))
    put('megatron', 'neg_token.bin+idx', megatron([[-1, 2]], 2))
    put('megatron', 'big_token.bin+idx', megatron([[1 << 40, 2]], 5))
    put('megatron', 'doc_idx.bin+idx', megatron(docs, 8, doc_idx=[0, 2, 1, 3]))
    put('megatron', 'version.bin+idx', megatron(docs, 8, version=2))
    put('megatron', 'truncated.bin+idx', megatron(docs, 8, cut=5))


# ---- token_file --------------------------------------------------------------------------------
def mix(z):
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK
    return z ^ (z >> 31)


def token_file(tokens, vocab, width=2, checksum=None, version=1, count=None, reserved=b'\0' * 24):
    s = 0
    for i, t in enumerate(tokens):
        s = (s + mix((i * 0x9e3779b97f4a7c15 + t) & MASK)) & MASK
    head = b'TSLTOKEN' + struct.pack('<IIQQQ', version, width, vocab,
                                     len(tokens) if count is None else count,
                                     s if checksum is None else checksum)
    body = struct.pack('<%d%s' % (len(tokens), 'H' if width == 2 else 'I'), *tokens)
    return head + reserved + body


def token_seeds():
    toks = [0, 1, 2, 255, 256, 3, 7]
    put('token_file', 'valid16.tok', token_file(toks, 257))
    put('token_file', 'valid32.tok', token_file(toks + [70000], 70001, width=4))
    put('token_file', 'empty.tok', token_file([], 1))
    put('token_file', 'bad_checksum.tok', token_file(toks, 257, checksum=1))
    put('token_file', 'id_over_vocab.tok', token_file(toks, 10))
    put('token_file', 'width3.tok', token_file(toks, 257, width=3))
    put('token_file', 'vocab0.tok', token_file(toks, 0))
    put('token_file', 'count_big.tok', token_file(toks, 257, count=(1 << 63) + 1))
    put('token_file', 'reserved.tok', token_file(toks, 257, reserved=b'\1' + b'\0' * 23))
    put('token_file', 'version.tok', token_file(toks, 257, version=2))
    put('token_file', 'short.tok', b'TSLTOKEN\1\0')
    put('token_file', 'not_tokens.tok', b'hello world')


# ---- box, parse_integer, etcd_json -------------------------------------------------------------
def small_seeds():
    # First byte: the shape (rank = byte % 4, dims from its higher bits, see box_fuzz.cpp).
    for i, (shape_byte, text) in enumerate([
            (2 | (4 << 2) | (3 << 4), '0:2, 1:3'), (2, ':,:'), (3, '1, -1, :'), (1, '-9223372036854775808'),
            (1, '9223372036854775807'), (2, ' 3 : 1 , 0'), (1, ''), (2, 'a:b'), (1, '0:0'),
            (3 | (5 << 2), '-1:, :9223372036854775807'), (1, '1,2,3,4')]):
        put('box', f'box{i}', bytes([shape_byte]) + text.encode())
    for i, text in enumerate(['2', '1048576', '1048577', '0', '-0', '+3', ' 4', '4 ', '2.5', '2abc',
                              '9223372036854775807', '9223372036854775808',
                              '-9223372036854775808', '-9223372036854775809', '0x10', '']):
        put('parse_integer', f'int{i}', text)
    seeds = [
        {'header': {'cluster_id': '1', 'member_id': '2', 'revision': '42', 'raft_term': '3'},
         'kvs': [{'key': 'L3Rlc3NlbA==', 'create_revision': '5', 'mod_revision': '41',
                  'version': '3', 'value': 'eA==', 'lease': '7587871'}], 'count': '1'},
        {'header': {'revision': 7}, 'events': [{'type': 'DELETE', 'kv': {'mod_revision': '7'},
                                               'prev_kv': {'version': '-1'}}]},
        {'header': {'revision': '18446744073709551616'}, 'ID': '1e3', 'TTL': None},
        {'revision': 18446744073709551615, 'lease': -9223372036854775808, 'ttl': 1.5},
        {'responses': [{'response_put': {}}], 'count': ['1']},
    ]
    for i, s in enumerate(seeds):
        put('etcd_json', f'gateway{i}.json', json.dumps(s))
    # Values a cluster's etcd may hold (signed_envelope_fuzz.cpp): a member's envelope, one of
    # another secret, one copied from another key, unsigned values and broken envelopes.
    key = '/tessel/fuzz/decisions/records/1'
    def seal(secret, k, value):
        mac = hmac.new(secret, k.encode() + b'\0' + value, hashlib.sha256).hexdigest()
        return b'tsig1.' + mac.encode() + b'.' + value
    for i, v in enumerate([
            seal(b'fuzz-secret-0123456789', key, b'{"generation": 1}'),
            seal(b'fuzz-secret-0123456789', key, b''),
            seal(b'another-secret-987654', key, b'{"generation": 1}'),
            seal(b'fuzz-secret-0123456789', '/tessel/fuzz/other', b'x'),
            b'{"generation": 1}', b'42', b'', b'tsig1.', b'tsig1.zz.value',
            b'tsig1.' + b'a' * 64 + b'.value', b'tsig2.' + b'a' * 64 + b'.value']):
        put('signed_envelope', f'value{i}', v)


# ---- tokenizer_json ---------------------------------------------------------------------------
def gpt2_bytes():
    """GPT-2's bytes_to_unicode order (data/bpe_test_data.h): printable bytes, then the others."""
    bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = [chr(b) for b in bs]
    n = 0x100
    for b in range(256):
        if b not in bs:
            bs.append(b)
            chars.append(chr(n))
            n += 1
    return chars


def tokenizer_json(model_type='BPE', merges=None, pre=None, added=True, extra_vocab=None):
    vocab = {c: i for i, c in enumerate(gpt2_bytes())}
    merged = ['he', 'll', 'hell', 'hello', '\u0120w', 'or', '\u0120wor', 'ld', '\u0120world']
    for i, t in enumerate(merged):
        vocab[t.encode().decode('unicode_escape')] = 256 + i
    vocab.update(extra_vocab or {})
    if merges is None:
        merges = ['h e', 'l l', 'he ll', 'hell o', '\u0120 w', 'o r', '\u0120w or', 'l d',
                  '\u0120wor ld']
        merges = [m.encode().decode('unicode_escape') for m in merges]
    vocab['<|endoftext|>'] = 265
    j = {'version': '1.0',
         'added_tokens': [{'id': 265, 'content': '<|endoftext|>', 'special': True}] if added else [],
         'normalizer': None,
         'pre_tokenizer': pre if pre is not None else
         {'type': 'ByteLevel', 'add_prefix_space': False, 'use_regex': True},
         'model': {'type': model_type, 'vocab': vocab, 'merges': merges, 'byte_fallback': False}}
    return json.dumps(j, ensure_ascii=False)


def tokenizer_seeds():
    put('tokenizer_json', 'gpt2.json', tokenizer_json())
    put('tokenizer_json', 'llama3.json', tokenizer_json(pre={'type': 'Sequence', 'pretokenizers': [
        {'type': 'Split', 'pattern': {'Regex': "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
         'behavior': 'Isolated', 'invert': False},
        {'type': 'ByteLevel', 'add_prefix_space': False, 'use_regex': False}]}))
    put('tokenizer_json', 'wordpiece.json', tokenizer_json(model_type='WordPiece'))
    put('tokenizer_json', 'bad_merge.json', tokenizer_json(merges=['h zz']))
    put('tokenizer_json', 'no_added.json', tokenizer_json(added=False))
    put('tokenizer_json', 'cut.json', tokenizer_json()[:300])


def main():
    yaml_config()
    safetensors_seeds()
    hf_seeds()
    checkpoint_seeds()
    megatron_seeds()
    token_seeds()
    tokenizer_seeds()
    small_seeds()


if __name__ == '__main__':
    main()
