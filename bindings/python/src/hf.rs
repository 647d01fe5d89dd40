//! The model a cache is built for, from Python: a catalogue name, or a Hugging Face
//! `config.json` as a dict, mapped by `unikv_workload::model_from_hf_config`.

use crate::errors::invalid;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;
use unikv::ModelSpec;

/// The model `value` names: a catalogue name (`str`) or a config dict (named `name`,
/// else by its `_name_or_path` or `model_type`). A config it cannot map raises
/// `InvalidArgument` naming the field.
pub fn model(value: &Bound<'_, PyAny>, name: Option<&str>) -> PyResult<ModelSpec> {
    if let Ok(spec) = value.cast::<crate::engine::ModelSpec>() {
        return Ok(spec.get().spec());
    }
    if let Ok(text) = value.extract::<String>() {
        return ModelSpec::by_name(&text).ok_or_else(|| {
            invalid(format!(
                "unknown model {text:?} (known: {})",
                crate::model_names().join(", ")
            ))
        });
    }
    if !value.is_instance_of::<PyDict>() {
        return Err(invalid(
            "model: a catalogue name or a Hugging Face config.json dict",
        ));
    }
    let config = json(value, "config")?;
    let name = name
        .map(str::to_string)
        .or_else(|| text_field(&config, "_name_or_path"))
        .or_else(|| text_field(&config, "model_type"))
        .unwrap_or_else(|| "hf-config".into());
    unikv_workload::model_from_hf_config(&config, &name)
        .map_err(|e| invalid(format!("model config: {e}")))
}

fn text_field(config: &Value, key: &str) -> Option<String> {
    config.get(key).and_then(Value::as_str).map(str::to_string)
}

/// `value` as JSON. A float that JSON cannot hold (`inf`, `nan`: Nemotron-H's
/// `time_step_limit` has one) becomes `null`; no config field unikv reads is one.
fn json(value: &Bound<'_, PyAny>, at: &str) -> PyResult<Value> {
    if value.is_none() {
        return Ok(Value::Null);
    }
    if value.is_instance_of::<PyBool>() {
        return Ok(Value::Bool(value.extract()?));
    }
    if value.is_instance_of::<PyInt>() {
        if let Ok(i) = value.extract::<i64>() {
            return Ok(Value::from(i));
        }
        return Ok(Value::from(value.extract::<u64>().map_err(|_| {
            invalid(format!("model config: {at} is an integer past 64 bits"))
        })?));
    }
    if value.is_instance_of::<PyFloat>() {
        let f: f64 = value.extract()?;
        return Ok(serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number));
    }
    if value.is_instance_of::<PyString>() {
        return Ok(Value::String(value.extract()?));
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for (i, item) in value.try_iter()?.enumerate() {
            items.push(json(&item?, &format!("{at}[{i}]"))?);
        }
        return Ok(Value::Array(items));
    }
    if let Ok(dict) = value.cast::<PyDict>() {
        let mut map = serde_json::Map::new();
        for (k, v) in dict.iter() {
            let key: String = k.extract().map_err(|_| {
                invalid(format!("model config: {at} has a key that is not a string"))
            })?;
            let item = json(&v, &format!("{at}.{key}"))?;
            map.insert(key, item);
        }
        return Ok(Value::Object(map));
    }
    Err(invalid(format!(
        "model config: {at} is a {}, not a JSON value",
        value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}
