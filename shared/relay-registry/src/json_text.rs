//! Decoded values written as JSON text within a bound of their size on the
//! wire.

use crate::Undecoded;

/// How many times its size in the wire format a value may take as JSON: real
/// values take a few times theirs (Avro repeats field names, Protobuf writes
/// each default), a crafted one would take any amount of memory.
pub const JSON_EXPANSION: usize = 16;

/// JSON any value may take beyond [`JSON_EXPANSION`] times its size: room
/// for the defaults of a small message.
pub const JSON_SLACK_BYTES: usize = 64 * 1024;

/// The most bytes of JSON text a value of `wire` bytes is decoded to; a
/// value that would take more is [`Failure::Oversized`](crate::Failure::Oversized).
pub fn max_json_bytes(wire: usize) -> usize {
    wire.saturating_mul(JSON_EXPANSION).saturating_add(JSON_SLACK_BYTES)
}

/// JSON text kept in memory that refuses to grow past `limit` bytes, so a
/// value is never expanded further than its bound, not even for a moment.
pub(crate) struct Capped {
    buf: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let need = self.buf.len() + bytes.len();
        if need > self.limit {
            self.over = true;
            return Err(std::io::Error::other("over the bound"));
        }
        if need > self.buf.capacity() {
            let want = need.max(self.buf.capacity() * 2).min(self.limit);
            self.buf.reserve_exact(want - self.buf.len());
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// serde_json's compact text, with an `f32` written as the `f64` it widens
/// to, as a `serde_json::Value` holds it: the text is what a value built
/// first and written after gave.
pub(crate) struct Widened;

impl serde_json::ser::Formatter for Widened {
    fn write_f32<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, value: f32) -> std::io::Result<()> {
        self.write_f64(writer, f64::from(value))
    }
}

/// The JSON text `write` serializes, of at most `limit` bytes.
pub(crate) fn json_text(
    limit: usize,
    write: impl FnOnce(&mut serde_json::Serializer<&mut Capped, Widened>) -> Result<(), serde_json::Error>,
) -> Result<Vec<u8>, Undecoded> {
    let mut out = Capped { buf: Vec::new(), limit, over: false };
    let result = write(&mut serde_json::Serializer::with_formatter(&mut out, Widened));
    match result {
        Ok(()) => Ok(out.buf),
        Err(_) if out.over => Err(Undecoded::TooLarge(limit)),
        Err(e) => Err(Undecoded::Invalid(e.to_string())),
    }
}
