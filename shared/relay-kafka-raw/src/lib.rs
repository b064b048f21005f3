//! A Kafka record's headers as bytes.
//!
//! rdkafka's safe API hands header names out as `&str` and unwraps the
//! UTF-8 check inside the library (`BorrowedHeaders::try_get`), so a record
//! whose header name is not UTF-8 — which Go's sarama and franz-go, or
//! librdkafka's C API, produce legally — panicked the consumer, and every
//! member the partition moved to after it (ingest review D1). Here the
//! headers are read through librdkafka's C API as bytes, and the relay
//! decides what such a record is (`bad_header` poison).
//!
//! This is the only crate of the workspace that allows `unsafe`; nothing
//! else in it is written by hand.

use std::ffi::CStr;
use std::os::raw::{c_char, c_void};

use rdkafka::bindings as rdsys;
use rdkafka::message::BorrowedMessage;
use relay_core::Header;

/// Every header of `message`, in wire order, names as bytes.
pub fn headers(message: &BorrowedMessage<'_>) -> Vec<Header> {
    let mut hdrs: *mut rdsys::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `message.ptr()` is the live `rd_kafka_message_t` the borrow
    // keeps alive; librdkafka only writes the out pointer, which then points
    // into the message (owned by it, not to be freed here).
    let err = unsafe { rdsys::rd_kafka_message_headers(message.ptr(), &mut hdrs) };
    if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for idx in 0.. {
        let mut name: *const c_char = std::ptr::null();
        let mut value: *const c_void = std::ptr::null();
        let mut size: usize = 0;
        // SAFETY: `hdrs` belongs to the message, alive for this borrow; the
        // out pointers are valid locals. Past the last header librdkafka
        // returns an error and writes nothing.
        let err = unsafe { rdsys::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size) };
        if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            break;
        }
        // SAFETY: librdkafka keeps header names NUL-terminated, and the name
        // lives as long as the headers; it is copied before the borrow ends.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        let value = if value.is_null() {
            None
        } else {
            // SAFETY: a non-null value points at `size` bytes owned by the
            // headers, copied here before the borrow ends.
            Some(unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec())
        };
        out.push(Header::from_wire(name, value));
    }
    out
}
