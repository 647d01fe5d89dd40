//! `--model NAME[:KEY=VALUE,...]`: a named model, or its geometry changed key by key, so a
//! model the crate does not name runs from the command line
//! (`gpt-oss-120b:window=256,full-layers=24`).

use crate::error::WorkloadError;
use unikv::ModelSpec;

/// What one key sets.
type Setter = fn(&mut ModelSpec, u32);

/// The keys of a `--model` override, each the field it sets.
const KEYS: [(&str, Setter); 17] = [
    ("full-layers", |m, v| m.full_layers = v),
    ("swa-layers", |m, v| m.swa_layers = v),
    ("mamba-layers", |m, v| m.mamba_layers = v),
    ("window", |m, v| m.window = v),
    ("full-heads", |m, v| m.full.kv_heads = v),
    ("full-head-dim", |m, v| m.full.head_dim = v),
    ("full-dtype-bytes", |m, v| m.full.dtype_bytes = v),
    ("swa-heads", |m, v| m.swa.kv_heads = v),
    ("swa-head-dim", |m, v| m.swa.head_dim = v),
    ("swa-dtype-bytes", |m, v| m.swa.dtype_bytes = v),
    ("conv-channels", |m, v| m.recurrent.conv_channels = v),
    ("conv-kernel", |m, v| m.recurrent.conv_kernel = v),
    ("state-heads", |m, v| m.recurrent.heads = v),
    ("state-head-dim", |m, v| m.recurrent.head_dim = v),
    ("state-size", |m, v| m.recurrent.state_size = v),
    ("conv-dtype-bytes", |m, v| m.recurrent.conv_dtype_bytes = v),
    ("state-dtype-bytes", |m, v| {
        m.recurrent.state_dtype_bytes = v
    }),
];

/// The keys, for messages and help.
pub fn override_keys() -> String {
    KEYS.map(|(k, _)| k).join(", ")
}

/// The model `spec` names: `NAME` or `NAME:KEY=VALUE,...` (keys in [`override_keys`],
/// values integers up to 2^32 - 1, each key at most once). A changed model is named by its
/// whole spec (leaked once per parse: a command-line value), so reports and recorded op
/// traces say what ran and `bench-ops` rebuilds the same geometry. The cache builder
/// checks the geometry itself.
pub fn parse_model(spec: &str) -> Result<ModelSpec, WorkloadError> {
    let spec = spec.trim();
    let (name, overrides) = spec.split_once(':').unwrap_or((spec, ""));
    let mut model = ModelSpec::by_name(name.trim()).ok_or_else(|| WorkloadError::UnknownModel {
        name: name.to_string(),
        known: ModelSpec::NAMED.map(|m| m.name).join(", "),
    })?;
    if overrides.trim().is_empty() {
        return Ok(model);
    }
    let bad = |reason: String| WorkloadError::BadModel {
        spec: spec.to_string(),
        reason,
    };
    let mut seen: Vec<&str> = Vec::new();
    for item in overrides.split(',') {
        let (key, value) = item
            .split_once('=')
            .map(|(k, v)| (k.trim(), v.trim()))
            .ok_or_else(|| bad(format!("{:?} is not KEY=VALUE", item.trim())))?;
        let set = KEYS
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, set)| set)
            .ok_or_else(|| bad(format!("unknown key {key:?} (keys: {})", override_keys())))?;
        if seen.contains(&key) {
            return Err(bad(format!("{key} is given twice")));
        }
        seen.push(key);
        let value = value.parse::<u32>().map_err(|_| {
            bad(format!(
                "{key}={value:?} is not an integer from 0 to 2^32-1"
            ))
        })?;
        set(&mut model, value);
    }
    model.name = Box::leak(spec.to_string().into_boxed_str());
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_alone_is_the_named_model_and_overrides_change_only_their_fields() {
        assert_eq!(parse_model("gpt-oss-20b").unwrap(), ModelSpec::GPT_OSS_20B);
        let m = parse_model(" gpt-oss-120b:window=256, full-layers=24 ").unwrap();
        let mut want = ModelSpec::GPT_OSS_120B;
        (want.window, want.full_layers) = (256, 24);
        want.name = m.name;
        assert_eq!(m, want);
        assert_eq!(m.name, "gpt-oss-120b:window=256, full-layers=24");
        let tri = parse_model("synthetic-tri:state-size=64,conv-kernel=2").unwrap();
        assert_eq!(
            (tri.recurrent.state_size, tri.recurrent.conv_kernel),
            (64, 2)
        );
        // Every key sets its own field.
        for (key, _) in KEYS {
            let m = parse_model(&format!("synthetic-tri:{key}=4242")).unwrap();
            assert_ne!(
                format!("{m:?}").replace(m.name, ""),
                format!("{:?}", ModelSpec::SYNTHETIC_TRI).replace("synthetic-tri", ""),
                "{key}"
            );
        }
    }

    #[test]
    fn a_bad_override_is_an_error_naming_it() {
        for (spec, needle) in [
            ("llama:window=1", "unknown model"),
            ("gpt-oss-20b:windw=1", "unknown key \"windw\""),
            ("gpt-oss-20b:window", "is not KEY=VALUE"),
            ("gpt-oss-20b:window=-1", "window=\"-1\" is not an integer"),
            ("gpt-oss-20b:window=1,window=2", "window is given twice"),
        ] {
            let err = parse_model(spec).unwrap_err().to_string();
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }
}
