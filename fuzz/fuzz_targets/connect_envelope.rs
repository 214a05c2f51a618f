//! The Connect envelope decoder, fed the input in chunks whose sizes the input picks:
//! it never panics, never yields more than it was given, and a whole re-encoded
//! envelope decodes to itself.
#![no_main]
use hutch_proto::envelope::{encode, Decoder, MAX_MESSAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let mut decoder = Decoder::default();
    let mut yielded = 0usize;
    for chunk in rest.chunks(usize::from(split).max(1)) {
        decoder.push(chunk);
        while let Ok(Some(env)) = decoder.next_envelope() {
            assert!(env.payload.len() <= MAX_MESSAGE);
            yielded += 5 + env.payload.len();
            let mut again = Decoder::default();
            again.push(&encode(env.flags, &env.payload));
            assert_eq!(again.next_envelope().ok().flatten(), Some(env));
        }
    }
    assert!(yielded + decoder.pending() <= rest.len());
});
