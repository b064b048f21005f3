//! The wire format: a magic byte, the schema id, the encoded value; and the
//! encoder that writes JSON data under a registered JSON Schema.

use serde_json::Value;

use crate::MAGIC;

/// The wire format's header for schema `id`.
pub(crate) fn header(id: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    v.push(MAGIC);
    v.extend(id.to_be_bytes());
    v
}

/// JSON checked against a JSON Schema, in the wire format.
pub(crate) struct JsonEncoder {
    id: u32,
    validator: jsonschema::Validator,
    describe: String,
}

impl JsonEncoder {
    /// The encoder of data checked by `validator`, written under schema
    /// `id`; `describe` names the schema in errors.
    pub(crate) fn new(id: u32, validator: jsonschema::Validator, describe: String) -> Self {
        JsonEncoder { id, validator, describe }
    }
}

impl std::fmt::Debug for JsonEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

impl relay_core::effects::DataEncoder for JsonEncoder {
    fn encode(&self, data: &Value) -> Result<Vec<u8>, String> {
        let errors: Vec<String> =
            self.validator.iter_errors(data).take(5).map(|e| relay_core::router::schema_failure(&e)).collect();
        if !errors.is_empty() {
            return Err(errors.join("; "));
        }
        let mut v = header(self.id);
        serde_json::to_writer(&mut v, data).map_err(|e| e.to_string())?;
        Ok(v)
    }

    fn content_type(&self) -> &str {
        "application/json"
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// The schema id and the encoded value of a value in the wire format.
pub fn split(bytes: &[u8]) -> Result<(u32, &[u8]), String> {
    match bytes {
        // Registries take ids as 32-bit signed integers: one above that is
        // no id (Confluent's and Apicurio's APIs answer it with a bare 404).
        [MAGIC, a, b, c, d, rest @ ..] => match u32::from_be_bytes([*a, *b, *c, *d]) {
            id if i32::try_from(id).is_err() => {
                Err(format!("value names schema id {id}, above the largest a registry gives (2^31 - 1)"))
            }
            id => Ok((id, rest)),
        },
        [MAGIC, ..] => Err(format!(
            "value of {} byte(s) is too short for the Schema Registry wire format (magic byte, 4-byte schema id)",
            bytes.len()
        )),
        [first, ..] => Err(format!(
            "value starts with byte {first:#04x}, not the Schema Registry wire format's magic byte 0x00 \
             (produced without a registry serializer?)"
        )),
        [] => Err("value is empty, not in the Schema Registry wire format".into()),
    }
}
