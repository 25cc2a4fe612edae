//! Human-readable durations (`500ms`, `1s`, `2m`, `1h30m`) as used in job files and manifests.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A duration written the way Kubernetes users write them: a sequence of `<number><unit>` with
/// units `ms`, `s`, `m`, `h` (for example `1s`, `250ms`, `1m30s`). Serialized back in the same form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// Builds a duration from milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        HumanDuration(Duration::from_millis(ms))
    }

    /// Builds a duration from seconds.
    pub const fn from_secs(s: u64) -> Self {
        HumanDuration(Duration::from_secs(s))
    }

    /// The duration in whole milliseconds.
    pub fn as_millis(&self) -> u64 {
        self.0.as_millis() as u64
    }

    /// Parses `1s`, `250ms`, `1m30s`, `2h`. A bare `0` is accepted as zero.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "0" {
            return Ok(HumanDuration(Duration::ZERO));
        }
        if text.is_empty() {
            return Err("empty duration".into());
        }
        let mut total_ms: u128 = 0;
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if start == i {
                return Err(format!(
                    "`{text}` is not a duration: expected a number at position {start} (write e.g. 500ms, 1s, 2m, 1h)"
                ));
            }
            let number: u128 = text[start..i].parse().map_err(|_| format!("`{text}`: number too large"))?;
            let unit_start = i;
            while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
                i += 1;
            }
            let factor: u128 = match &text[unit_start..i] {
                "ms" => 1,
                "s" => 1_000,
                "m" => 60_000,
                "h" => 3_600_000,
                "" => return Err(format!("`{text}` needs a unit (ms, s, m or h)")),
                other => return Err(format!("`{text}`: unknown unit `{other}` (use ms, s, m or h)")),
            };
            total_ms = total_ms.saturating_add(number.saturating_mul(factor));
        }
        let ms = u64::try_from(total_ms).map_err(|_| format!("`{text}` is too long"))?;
        Ok(HumanDuration(Duration::from_millis(ms)))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.as_millis();
        if ms == 0 {
            write!(f, "0s")
        } else if ms.is_multiple_of(3_600_000) {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms.is_multiple_of(60_000) {
            write!(f, "{}m", ms / 60_000)
        } else if ms.is_multiple_of(1_000) {
            write!(f, "{}s", ms / 1_000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

#[cfg(feature = "kubernetes")]
impl schemars::JsonSchema for HumanDuration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "HumanDuration".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^(0|([0-9]+(ms|s|m|h))+)$",
            "description": "A duration such as 500ms, 1s, 1m30s or 2h."
        })
    }

    fn inline_schema() -> bool {
        true
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        HumanDuration::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_sums() {
        assert_eq!(HumanDuration::parse("500ms").unwrap().as_millis(), 500);
        assert_eq!(HumanDuration::parse("1m30s").unwrap().as_millis(), 90_000);
        assert_eq!(HumanDuration::parse("2h").unwrap().as_millis(), 7_200_000);
        assert_eq!(HumanDuration::parse("0").unwrap().as_millis(), 0);
    }

    #[test]
    fn rejects_bad_text_with_a_reason() {
        assert!(HumanDuration::parse("-1s").unwrap_err().contains("expected a number"));
        assert!(HumanDuration::parse("10").unwrap_err().contains("needs a unit"));
        assert!(HumanDuration::parse("3d").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn displays_in_largest_whole_unit() {
        assert_eq!(HumanDuration::from_millis(90_000).to_string(), "90s");
        assert_eq!(HumanDuration::from_millis(120_000).to_string(), "2m");
        assert_eq!(HumanDuration::from_millis(1500).to_string(), "1500ms");
    }
}
