//! Status sets: which upstream statuses a route stores (`"2xx"`, `"303"`,
//! `"200-299"`).

use std::fmt;
use std::ops::RangeInclusive;
use std::str::FromStr;

use http::StatusCode;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A set of status codes, written as `"2xx"`, `"303"` or `"200-299"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusSet(Vec<RangeInclusive<u16>>);

impl StatusSet {
    /// Whether `status` is in the set.
    pub fn contains(&self, status: StatusCode) -> bool {
        let code = status.as_u16();
        self.0.iter().any(|range| range.contains(&code))
    }
}

impl Default for StatusSet {
    /// `2xx` and `3xx`: successes and redirects (a 303 Post/Redirect/Get is
    /// replayed as the same redirect).
    fn default() -> Self {
        StatusSet(vec![200..=299, 300..=399])
    }
}

impl FromStr for StatusSet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut ranges = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            ranges.push(parse_status_range(part)?);
        }
        Ok(StatusSet(ranges))
    }
}

fn parse_status_range(part: &str) -> Result<RangeInclusive<u16>, String> {
    let code = |s: &str| -> Result<u16, String> {
        match s.trim().parse::<u16>() {
            Ok(code) if (100..=599).contains(&code) => Ok(code),
            _ => Err(format!("`{s}` is not an HTTP status code (100..=599)")),
        }
    };
    if let Some(class) = part.strip_suffix("xx").or_else(|| part.strip_suffix("XX")) {
        return match class {
            "1" | "2" | "3" | "4" | "5" => {
                let start = class.parse::<u16>().unwrap_or(0) * 100;
                Ok(start..=start + 99)
            }
            _ => Err(format!("`{part}` is not a status class (1xx..5xx)")),
        };
    }
    if let Some((from, to)) = part.split_once('-') {
        let (from, to) = (code(from)?, code(to)?);
        if from > to {
            return Err(format!("`{part}` is an empty range"));
        }
        return Ok(from..=to);
    }
    let code = code(part)?;
    Ok(code..=code)
}

impl fmt::Display for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, range) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            let (start, end) = (*range.start(), *range.end());
            if start == end {
                write!(f, "{start}")?;
            } else if start % 100 == 0 && end == start + 99 {
                write!(f, "{}xx", start / 100)?;
            } else {
                write!(f, "{start}-{end}")?;
            }
        }
        Ok(())
    }
}

impl Serialize for StatusSet {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let parts: Vec<String> = self
            .to_string()
            .split(',')
            .map(str::to_owned)
            .filter(|p| !p.is_empty())
            .collect();
        parts.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for StatusSet {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let parts = Vec::<String>::deserialize(deserializer)?;
        let mut ranges = Vec::new();
        for part in &parts {
            ranges.push(parse_status_range(part.trim()).map_err(serde::de::Error::custom)?);
        }
        Ok(StatusSet(ranges))
    }
}
