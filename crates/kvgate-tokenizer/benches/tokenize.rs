//! The cost of turning a chat request with an 8 KB user message into token ids: the tiny Hugging Face tokenizer (render + encode, render alone, encode alone, from the raw body) and the mock.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_tokenizer::{ChatOptions, Tokenizer};
use serde_json::json;

/// About 8 KB of prose, code and numbers (the shape of make_reference.py's long case).
fn user_text() -> String {
    let paragraph = "The gateway routes each request to the engine replica that already holds the longest \
        prefix of its prompt in the KV cache, unless that replica is overloaded. \
        fn select(&self, request: &Request) -> Result<Decision, NoRoute> { todo!() } \
        Latency p50=12.5ms p99=184ms; hit rate 73.2% over 10000 requests.\n";
    let mut text = String::new();
    let mut index = 0;
    while text.len() < 8192 {
        text.push_str(&format!("{index}. {paragraph}"));
        index += 1;
    }
    text
}

fn bench_tokenize(c: &mut Criterion) {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("tiny-chatml");
    let hf = Tokenizer::from_path(&model, None).expect("load tiny-chatml");
    let mock = Tokenizer::mock();
    let text = user_text();
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text},
    ]);
    let body = json!({"model": "tiny", "messages": messages, "stream": true}).to_string();
    let options = ChatOptions::default();
    let rendered = hf.render_chat(&messages, &options).expect("render");

    let mut group = c.benchmark_group("chat_8kb");
    group.sample_size(30);
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.bench_function("hf_render_and_encode", |b| {
        b.iter(|| hf.encode_chat(black_box(&messages), &options).expect("encode"))
    });
    group.bench_function("hf_render_only", |b| {
        b.iter(|| hf.render_chat(black_box(&messages), &options).expect("render"))
    });
    group.bench_function("hf_encode_only", |b| {
        b.iter(|| hf.encode_prompt(black_box(&rendered)).expect("encode"))
    });
    group.bench_function("hf_from_request_body", |b| {
        b.iter(|| hf.encode_chat_request(black_box(body.as_bytes())).expect("encode"))
    });
    group.bench_function("mock_render_and_encode", |b| {
        b.iter(|| mock.encode_chat(black_box(&messages), &options).expect("encode"))
    });
    group.finish();
}

criterion_group!(benches, bench_tokenize);
criterion_main!(benches);
